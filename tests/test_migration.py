"""Moving decoding requests between decode workers (``router.migration``, ``decode.migrate``) and draining a worker
(``router.drain``, ``pdserve drain``), through ``pdserve up --decode 2`` and the ``openai`` SDK: streams drained off
a worker mid-way end with every token and the text of an undisturbed run, greedy, with a JSON schema and with
``n=2``; the drained worker's blocks all come back; bad input gets a clear 4xx."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from deploy.local import Cluster
from pdserve.cli import main as pdserve
from tests.moves import (SCHEMA, TOKENS, check_drained, decode_workers, drain_busiest, drained_mid_way,  # noqa: F401
                         health, model, moved, run_streams, undrain, until_moved)
from tests.test_failures import eventually


@pytest.fixture(scope="module")
def cluster(model):
    c = Cluster("--decode", "2", "--model", model, "--policy", "round_robin").wait_ready()
    yield c
    c.stop()


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=11, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0, min_tokens=30, stop=["zz"], max_tokens=40),
])
def test_a_sequence_moved_mid_way_with_its_kv_goes_on_as_the_whole_one(params):
    """The state a move carries (prompt, output tokens, detokenizer position, resolved parameters) and the KV of every
    token but the last, into a second engine: seeded noise, penalties, min_tokens and stop strings go on exactly."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.requests import resumed_sequence
    from engine.sequence import Sequence

    a, b = (Engine(EngineConfig(model="tiny-llama", threads=1)) for _ in range(2))
    prompt = list(range(5, 60))
    whole = generate_many(a, [prompt], [SamplingParams(**{"max_tokens": 40, **params})])[0][1]
    part = Sequence.create("part", prompt, SamplingParams(**{"max_tokens": 40, **params}), a.tokenizer, a.max_len)
    a.add(part)
    while len(part.output_ids) < 17:  # one token a step: the source's state when the move began
        a.step()
    a.scheduler.remove(part)
    seq = resumed_sequence(b, "moved", part.prompt_ids, part.output_ids[-1], part.detok.emitted, part.params.to_dict(),
                           part.output_ids[:-1])
    assert b.add_prefilled(seq, a.pool.gather(part.block_table, part.num_tokens - 1))
    while not seq.finished:
        b.step()
    assert seq.output_ids == whole.output_ids and seq.detok.text == whole.detok.text


@pytest.mark.parametrize("variant", ["greedy", "json_schema", "n2"])
def test_a_drained_worker_hands_its_streams_over_mid_way_and_each_ends_as_undisturbed(cluster, model, variant):
    name = model.rsplit("/", 1)[1]
    body = {"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if variant == "json_schema":
        body = {"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}}
    if variant == "n2":
        body = {**body, "n": 2, "temperature": 0.8, "seed": 7}
    bodies = [{**body, "prompt": f"stream {i} of eight: the quick brown fox"} for i in range(8 if variant == "greedy" else 4)]
    want, _ = run_streams(cluster.url, bodies)
    before = moved(cluster.url)
    got, address = drained_mid_way(cluster.url, bodies)
    try:
        assert [s.texts for s in got] == [s.texts for s in want]
        if variant != "json_schema":  # a schema's answer may end before max_tokens, the same in both runs
            assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
        else:
            assert all(json.loads(t) for s in got for t in s.texts.values())
        assert moved(cluster.url) > before
        check_drained(cluster.url, address)
        source = next(w for w in decode_workers(cluster.url) if w["address"] == address)
        assert source["migrations_sent_ahead_tokens"] > 0  # the full blocks went ahead of each pause
        assert eventually(lambda: all(w["kv_blocks_free"] == w["kv_blocks"] and w["kv_reserved_bytes"] == 0
                                      for w in decode_workers(cluster.url)), 30)  # nothing held anywhere
    finally:
        undrain(cluster.url, address)


@pytest.mark.parametrize("arena", ["roomy", "full"])
def test_streams_drained_over_the_nccl_protocol_end_as_undisturbed(model, arena):
    """The nccl transport's protocol (over gloo): the KV copied out into the sender's own memory, or, where that has
    no room, one piece a layer that the sender joins in one copy; either way the texts of an undisturbed run."""
    room = ("--kv-option", "nccl_pool_bytes=4096") if arena == "full" else ()
    c = Cluster("--decode", "2", "--model", model, "--policy", "round_robin", "--transport", "nccl", "--device", "cpu",
                "--kv-option", "nccl_backend=gloo", *room).wait_ready()
    try:
        name = model.rsplit("/", 1)[1]
        bodies = [{"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True},
                   "prompt": f"stream {i} of four: the quick brown fox"} for i in range(4)]
        want, _ = run_streams(c.url, bodies)
        got, address = drained_mid_way(c.url, bodies)
        assert [s.texts for s in got] == [s.texts for s in want]
        assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
        assert moved(c.url) > 0
        check_drained(c.url, address)
    finally:
        c.stop()


def test_streams_whose_source_is_lost_mid_move_are_computed_again_on_the_target(model, monkeypatch):
    """The source pauses the drained streams and is killed before any KV leaves it (a test hook holds its pushes):
    the target computes each one's tokens again and goes on; every stream ends with the undisturbed run's text.
    (Round robin puts two streams on each worker: both move at once, ``router.drain.IN_FLIGHT``.)"""
    monkeypatch.setenv("PDSERVE_TEST_HOLD_MOVES", "1")
    c = Cluster("--decode", "2", "--model", model, "--policy", "round_robin").wait_ready()
    try:
        name = model.rsplit("/", 1)[1]
        bodies = [{"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True},
                   "prompt": f"stream {i} of four: the quick brown fox"} for i in range(4)]
        want, _ = run_streams(c.url, bodies)

        def drain_and_kill(url):
            address = drain_busiest(url)
            source = lambda: next(w for w in decode_workers(url) if w["address"] == address)  # noqa: E731
            assert eventually(lambda: 0 < source()["migrations_paused"] == source()["active"], 30)  # all paused
            os.kill(source()["pid"], signal.SIGKILL)
            return address
        got, _ = run_streams(c.url, bodies, drain_and_kill)
        assert [s.texts for s in got] == [s.texts for s in want]
        assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
        text = httpx.get(c.url + "/metrics", timeout=10).text
        assert 'outcome="recomputed"' in text and 'outcome="moved"' not in text
    finally:
        c.stop()


def test_drain_refuses_an_unknown_worker_and_the_last_of_its_role_unless_forced(cluster):
    r = httpx.post(cluster.url + "/admin/drain", json={"worker": "tcp://127.0.0.1:1"}, timeout=10)
    assert r.status_code == 404 and "no worker 'tcp://127.0.0.1:1'" in r.json()["error"]["message"]
    assert httpx.post(cluster.url + "/admin/drain", json={"worker": 3}, timeout=10).status_code == 400
    prefill = health(cluster.url)["workers"]["prefill"][0]["address"]
    r = httpx.post(cluster.url + "/admin/drain", json={"worker": prefill}, timeout=10)
    assert r.status_code == 409 and "last prefill worker" in r.json()["error"]["message"]
    first, second = (w["address"] for w in decode_workers(cluster.url))
    assert httpx.post(cluster.url + "/admin/drain", json={"worker": first}, timeout=10).json()["drain"] in (
        "draining", "drained")
    assert httpx.post(cluster.url + "/admin/drain", json={"worker": second}, timeout=10).status_code == 409
    try:
        r = httpx.post(cluster.url + "/admin/drain", json={"worker": second, "force": True}, timeout=10)
        assert r.status_code == 200
        assert health(cluster.url)["status"] == "unavailable"  # no decode worker in the picks
    finally:
        for address in (first, second):
            undrain(cluster.url, address)
    assert eventually(lambda: health(cluster.url)["status"] == "ok", 10)


def test_streams_move_between_a_single_rank_worker_and_groups(model):
    """KV of whole heads from a TP=1 decode worker into a TP=2 group (gloo ranks), each rank taking its heads, and into
    a two-stage pipeline, each stage taking its layers; and back: each rank (stage) of the group sends its heads (its
    layers) from its pool (``kv_push`` on the plan), the single rank joins them. Every move's streams end as on the
    single worker alone, and each source's blocks all come back. (One fleet: the moves one after another.)"""
    from tests.fleet import Fleet

    name = model.rsplit("/", 1)[1]
    bodies = [{"model": name, "prompt": f"moving to a group {i}", "max_tokens": TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}} for i in range(2)]
    with Fleet("--model", model) as fleet:
        fleet.worker("p", "prefill")
        fleet.worker("one", "decode")
        fleet.worker("tp", "decode", "--tp", "2")
        fleet.worker("pp", "decode", "--pp", "2")
        fleet.router()
        fleet.wait_healthy()
        decoders = [fleet.addrs[n] for n in ("one", "tp", "pp")]

        def only(address):  # every stream starts there
            for other in decoders:
                if other != address:
                    assert pdserve(["drain", "--url", fleet.url, "--worker", other]) == 0
            undrain(fleet.url, address)

        only(fleet.addrs["one"])
        want, _ = run_streams(fleet.url, bodies)
        for group in ("tp", "pp"):
            for source, target in ((fleet.addrs["one"], fleet.addrs[group]), (fleet.addrs[group], fleet.addrs["one"])):
                only(source)

                def move(url):
                    undrain(url, target)
                    assert pdserve(["drain", "--url", url, "--worker", source]) == 0
                    return source

                (got, _), _ = until_moved(fleet.url, lambda: run_streams(fleet.url, bodies, move),
                                          lambda _: only(source))
                assert [s.texts for s in got] == [s.texts for s in want], (source, target)
                check_drained(fleet.url, source)


def test_a_rolling_restart_of_pdserve_up_ends_no_stream(model):
    """``kill -HUP`` on ``pdserve up``: every worker restarted in turn, the decode workers drained first (their
    streams moved), the lone prefill worker through its own drain; streams started before end as undisturbed."""
    import os
    import signal

    name = model.rsplit("/", 1)[1]
    bodies = [{"model": name, "prompt": f"rolling {i}", "max_tokens": TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}} for i in range(4)]
    cluster = Cluster("--decode", "2", "--model", model).wait_ready()
    try:
        want, _ = run_streams(cluster.url, bodies)

        def restarted(times):
            workers = [w for group in health(cluster.url)["workers"].values() for w in group]
            return all(w.get("restarts") == times and w["healthy"] and w["drain"] == "serving" for w in workers)
        for times in range(1, 4):  # again where every stream ended before its worker's drain (a busy machine)
            got, _ = run_streams(cluster.url, bodies, lambda url: os.kill(cluster.proc.pid, signal.SIGHUP))
            assert [s.texts for s in got] == [s.texts for s in want]
            assert eventually(lambda: restarted(times), 120)  # noqa: B023 (called within the iteration)
            if moved(cluster.url) >= 1:
                break
        assert moved(cluster.url) >= 1
    finally:
        cluster.stop()


def test_a_move_the_target_refuses_leaves_the_stream_decoding_where_it_was(model):
    """The target's KV budget cannot hold the request (a 503 there): the source decodes on, the client notices
    nothing, the move counts as failed, and the drained worker ends drained once its streams end."""
    from tests.fleet import Fleet

    name = model.rsplit("/", 1)[1]
    bodies = [{"model": name, "prompt": f"nowhere to go {i}", "max_tokens": TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}} for i in range(2)]
    with Fleet("--model", model) as fleet:
        fleet.worker("p", "prefill")
        fleet.worker("roomy", "decode")
        fleet.worker("full", "decode", "--kv-budget", "1M")  # a 144-token context: a request there is retried elsewhere
        fleet.router()
        fleet.wait_healthy()
        want, _ = run_streams(fleet.url, bodies)
        got, drained = run_streams(fleet.url, bodies, lambda url: pdserve(
            ["drain", "--url", url, "--worker", fleet.addrs["roomy"]]) == 0 and fleet.addrs["roomy"])
        assert drained == fleet.addrs["roomy"]
        assert [s.texts for s in got] == [s.texts for s in want]
        metrics = httpx.get(fleet.url + "/metrics", timeout=10).text
        assert 'pdserve_migrations_total{outcome="failed",reason="drain"}' in metrics
        assert moved(fleet.url) == 0
        check_drained(fleet.url, fleet.addrs["roomy"])
        assert fleet.worker_info("full")["active"] == 0 and fleet.worker_info("full")["kv_reserved_bytes"] == 0


def test_rebalancing_moves_the_shortest_request_off_a_pressed_worker_to_the_roomiest():
    from types import SimpleNamespace

    from router.rebalance import plan, pressed, roomy

    def worker(address, free, blocks=100, waiting=0, step=None, slo=None, active=1):
        return SimpleNamespace(address=address, info={"kv_blocks": blocks, "kv_blocks_free": free, "waiting": waiting,
                                                     "step_base_ms": step, "slo_tpot_ms": slo, "active": active})

    def run(where, prompt, moving=False):
        return SimpleNamespace(where=where, first={"prompt_tokens": prompt}, moving=moving)

    movable = lambda r: not r.moving  # noqa: E731
    full, half, empty, slow = worker("full", 5), worker("half", 50), worker("empty", 90), worker("slow", 60, step=12, slo=10)
    runs = [run(full, 900), run(full, 300), run(full, 100, moving=True), run(half, 10), run(slow, 50)]
    moves = plan([full, half, empty, slow], runs, movable, {}, 0.0)
    assert [(r.first["prompt_tokens"], r.where.address, t.address) for r, t in moves] == [
        (300, "full", "empty"), (50, "slow", "empty")]
    assert plan([full, half, empty], runs, movable, {"full": 5.0}, 1.0) == []  # cooling down
    assert plan([full, worker("warm", 20)], runs, movable, {}, 0.0) == []  # no worker with room
    waiting = worker("waiting", 50, waiting=1)
    assert plan([waiting, empty], [run(waiting, 7)], movable, {}, 0.0)[0][1] is empty
    idle = worker("idle", 90, step=250, slo=10, active=0)  # a slow step long ago: neither pressed nor short of room
    assert not pressed(idle) and roomy(idle)


def test_a_stream_moves_from_an_fp8_kv_cache_to_a_full_precision_one(model):
    """The source's FP8 KV goes as it is and the target converts it on arrival; every stream ends with all its
    tokens."""
    from tests.fleet import Fleet

    name = model.rsplit("/", 1)[1]
    bodies = [{"model": name, "prompt": f"from fp8 {i}", "max_tokens": TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}} for i in range(2)]
    with Fleet("--model", model) as fleet:
        fleet.worker("p", "prefill", "--kv-cache-dtype", "fp8")
        fp8 = fleet.worker("fp8", "decode", "--kv-cache-dtype", "fp8")
        fleet.worker("full", "decode")
        fleet.router()
        fleet.wait_healthy()
        assert pdserve(["drain", "--url", fleet.url, "--worker", fleet.addrs["full"]]) == 0  # both start on fp8

        def to_full(url):
            undrain(url, fleet.addrs["full"])
            assert pdserve(["drain", "--url", url, "--worker", fp8]) == 0
            return fp8

        got, _ = run_streams(fleet.url, bodies, to_full)
        assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
        assert moved(fleet.url) >= 1
        assert fleet.worker_info("full")["kv_converted"] >= 1  # (prompts went to fp8 only: these are the moves)
        check_drained(fleet.url, fp8)
