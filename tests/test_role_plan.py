"""``--roles auto --roles-profile`` (``router.role_plan``, ``router.traffic``): the router keeps the last minute's
traffic, the planner's model scores each split of the mixed workers on it, and the controller moves one worker a
cooldown toward the best split once two decisions agree; through ``pdserve up`` a burst of long prompts on a profile
where prompts are dear makes a second mixed worker prefill."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from deploy.local import Cluster
from planner.profile import Profile
from planner.search import SLO
from router.events import Delta, Finished
from router.role_control import COOLDOWN_S
from router.metrics import Metrics
from router.role_plan import AGREE, DECIDE_S, MIN_ENDED, RolePlan, goal, scores
from router.traffic import Traffic
from tests.moves import health
from tests.test_failures import eventually
from tests.test_role_control import cluster
from tests.test_roles import long_prompts, serving


def profile(prefill_ms_per_token: float) -> Profile:
    """Prefill ``1 ms + per_token x n``; decode ``5 ms + 0.05 ms a sequence + context reads``."""
    prefill = [{"tokens": n, "ms": 1.0 + prefill_ms_per_token * n} for n in (128, 1024, 8192)]
    decode = [{"batch": b, "context": c, "step_ms": 5.0 + 0.05 * b + 2e-5 * b * c}
              for b in (1, 16, 64, 256) for c in (512, 8192)]
    return Profile(model="synthetic", device="gpu", tp=1, prefill=prefill, decode=decode,
                   kv_bytes_per_token=131072, kv_capacity_tokens=1_000_000)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_traffic_is_the_last_minute_of_arrivals_and_of_the_lengths_of_requests_that_ended():
    clock = Clock()
    t = Traffic(window_s=60.0, clock=clock)
    for _ in range(30):
        t.arrived()
    t.finished(3000, 16)
    clock.now += 30
    assert t.rate() == pytest.approx(30 / 30)  # traffic began 30 s ago: not a whole window yet
    t.arrived()
    t.finished(200, 400)
    clock.now += 40  # the first 30 arrivals and the first ended request are more than a minute old
    assert t.rate() == pytest.approx(1 / 60) and t.lengths() == [(200, 400)]


def test_watch_counts_a_request_and_its_uncached_prompt_tokens_where_the_router_counted_them():
    async def events(uncached):
        yield Delta("a", [1], None)
        yield Finished("length", 900, 7, {} if uncached is None else {"uncached_tokens": uncached})

    async def main():
        t = Traffic()
        for uncached in (None, 100, 0):
            assert [type(e) for e in [e async for e in t.watch(events(uncached))]] == [Delta, Finished]
        return t
    t = asyncio.run(main())
    assert len(t.arrivals) == 3 and t.lengths() == [(900, 7), (100, 7), (1, 7)]


def test_the_model_gives_prompt_heavy_traffic_more_prefill_workers_than_generation_heavy_traffic():
    p, slo = profile(0.05), SLO(2000.0, 8.0)
    prompts = scores(p, (0, 0), 4, 8.0, [(3000, 16)] * 40, slo)  # one prefill worker: 150 ms a prompt, too few
    answers = scores(p, (0, 0), 4, 16.0, [(200, 600)] * 40, slo)  # one decode worker: too few within 8 ms
    assert set(prompts) == {1, 2, 3}  # each side keeps a worker
    assert goal(prompts, 1) >= 2 and goal(answers, 3) <= 2, (prompts, answers)


def test_the_goal_stays_where_the_current_split_scores_within_the_margin():
    assert goal({1: 0.90, 2: 0.93, 3: 0.5}, 1) == 1
    assert goal({1: 0.80, 2: 0.93, 3: 0.93}, 1) == 2  # of equals the nearest
    assert goal({1: 0.80, 2: 0.93}, 3) == 2  # the current split is not one of them (a side would be empty)
    assert goal({}, 2) == 2


def test_a_goal_counts_once_two_decisions_in_a_row_name_it(tmp_path):
    path = str(tmp_path / "p.json")
    profile(0.05).save(path)
    clock = Clock()
    traffic = Traffic(clock=clock)
    plan = RolePlan(path, traffic, 2000.0, 30.0, metrics=Metrics())

    async def main():
        assert await plan.decide(0.0, (0, 0), 4, 1) is None  # no ended requests yet
        for _ in range(8 * 30):  # 8 req/s for 30 s
            traffic.arrived()
            traffic.finished(3000, 16)
            clock.now += 1 / 8
        got = [await plan.decide(DECIDE_S * (i + 1), (0, 0), 4, 1) for i in range(AGREE)]
        assert await plan.decide(DECIDE_S * AGREE + 1, (0, 0), 4, 1) == got[-1]  # between decisions: the last
        return got
    try:
        got = asyncio.run(main())
    finally:
        plan.close()
    assert got[:-1] == [None] * (AGREE - 1) and got[-1] >= 2, (got, plan.scored)
    text = generate_latest(plan.metrics.registry).decode()
    assert f"pdserve_roles_plan_goal {float(got[-1])}" in text and 'pdserve_roles_plan_within_slo{prefilling="1"}' in text


def test_a_planning_process_that_fails_gives_no_goal_and_the_next_decision_starts_another(tmp_path):
    path = tmp_path / "p.json"
    profile(0.05).save(str(path))
    traffic = Traffic()
    for _ in range(MIN_ENDED):
        traffic.arrived()
        traffic.finished(3000, 16)
    plan = RolePlan(str(path), traffic, 2000.0, 30.0)

    async def main():
        path.unlink()  # the planning process cannot read it
        assert await plan.decide(0.0, (0, 0), 4, 1) is None and plan.pool is None
        profile(0.05).save(str(path))
        assert await plan.decide(DECIDE_S, (0, 0), 4, 1) is None and plan.pool is not None and plan.scored
    try:
        asyncio.run(main())
    finally:
        plan.close()


def test_bad_profiles_and_missing_slos_are_refused(tmp_path):
    from router.config import RouterConfig
    (tmp_path / "bad.json").write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="not a pdserve profile"):
        RolePlan(str(tmp_path / "bad.json"), Traffic(), 2000.0, 30.0)
    with pytest.raises(ValueError, match="roles_profile needs"):
        RouterConfig(decode=["tcp://127.0.0.1:1"], prefill=["tcp://127.0.0.1:2"], roles="auto",
                     roles_profile=str(tmp_path / "bad.json"))


def test_pdserve_up_refuses_a_profile_without_roles_auto_and_a_tpot_slo(tmp_path, capfd):
    from pdserve.cli import main as pdserve
    path = str(tmp_path / "p.json")
    profile(0.05).save(path)
    for extra in ([], ["--roles", "auto"], ["--slo-tpot-ms", "50"]):
        assert pdserve(["up", "--prefill", "0", "--decode", "0", "--mixed", "2", "--roles-profile", path] + extra) == 2
    assert "--roles-profile needs --roles auto and --slo-tpot-ms" in capfd.readouterr().err


class Plan:
    """A plan whose goal the test sets."""

    def __init__(self):
        self.target, self.asked = None, []

    async def decide(self, now, fixed, mixed, current):
        self.asked.append((fixed, mixed, current))
        return self.target

    def close(self):
        pass


def test_the_controller_moves_one_worker_a_cooldown_toward_the_plans_goal():
    async def main():
        control, p, d, mp, md = cluster()
        control.plan = Plan()
        assert await control.step(0.0) == ("m", "decode")  # settled first
        control.plan.target = 1  # the mixed worker should prefill
        assert await control.step(1.0) == ("m", "prefill")
        assert control.plan.asked[-1] == ((1, 1), 1, 0)  # one plain worker a side; m decoded
        control.plan.target = 0
        assert await control.step(2.0) is None  # the cooldown
        assert await control.step(2.0 + COOLDOWN_S) == ("m", "decode")
        control.plan.target = None  # no goal: the pressure rules
        for i in range(5):
            assert await control.step(3.0 + 2 * COOLDOWN_S + i) is None
    asyncio.run(main())


def test_pdserve_up_with_a_profile_moves_a_mixed_worker_to_prefill_under_long_prompts(tmp_path):
    """``--mixed 3`` settles to 1P2D. On a profile where a prompt of ~920 tokens takes 400 ms, 4 prompts a second
    overrun one prefill worker in the model (2.5 a second) and not two, and once two decisions agree the plan makes
    a second worker prefill (the pressure rules alone would not: the tiny model prefills such a prompt in tens of
    ms); every request is answered."""
    path = str(tmp_path / "dear-prompts.json")
    profile(0.43).save(path)
    c = Cluster("--prefill", "0", "--decode", "0", "--mixed", "3", "--roles", "auto", "--roles-profile", path,
                "--slo-tpot-ms", "50").wait_ready()
    try:
        assert eventually(lambda: serving(c.url) == {"prefill": 1, "decode": 2}, 30), health(c.url)["workers"]

        two = {"prefill": 2, "decode": 1}  # 4 a second for as long as AGREE + 2 decisions at most
        codes = asyncio.run(long_prompts(c.url, int(4 * DECIDE_S * (AGREE + 2)), 0.25, lambda: serving(c.url) == two))
        assert codes == [200] * len(codes)
        assert serving(c.url) == {"prefill": 2, "decode": 1}, health(c.url)["workers"]
    finally:
        left = c.stop()[1]
    assert left == []  # the router's planning process too


def test_the_window_replay_follows_a_shifting_load_on_the_model():
    """``bench.lab.roles_window`` (how the window and cadence were chosen): on a profile where prompts are dear, the
    prompt-heavy first phase takes the split to 3 of 4 prefilling."""
    from bench.lab.roles_window import replay
    changes = replay(profile(0.05), 20.0, 5.0, 8.0, (200, 400), SLO(2000.0, 15.0), phases=2)
    assert changes[0] == (0.0, 2) and (3 in [k for _, k in changes]), changes
