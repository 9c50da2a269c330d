"""Conditional disaggregation (``--disagg auto``): short prompts prefilled on their decode worker, long ones on a
prefill worker, both equal to the colocated reference (the cap of steps that decode: tests/test_step_budget.py)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deploy.local import Cluster
from tests.test_failures import eventually
from engine import EngineConfig
from engine.step_budget import StepRecord
from router.config import RouterConfig
from router.disagg import DisaggPolicy
from router.workers import WorkerClient


def worker(outstanding=0, prefilling=0, wait_ms=None, per_token=0.01, local_tokens=()):
    """A worker as the router sees it: ``wait_ms`` of prompt tokens in flight at ``per_token`` ms a token (None:
    no prompt step timed yet); ``local_tokens``: the local prompts it has in flight."""
    w = WorkerClient("tcp://127.0.0.1:1", "decode", {})
    w.outstanding, w.info = outstanding, {"prefilling": prefilling}
    if wait_ms is not None:
        w.info["step_times"] = {"prompt_ms_per_token": per_token}
        if wait_ms:
            w.prompt_tokens_out["in-flight"] = round(wait_ms / per_token)
    w.prompt_tokens_out.update({f"local-{i}": n for i, n in enumerate(local_tokens)})
    return w


@pytest.mark.parametrize("mode,uncached,prefill,decode,expected", [
    ("always", 10, [worker()], worker(), ("remote", "always")),
    ("never", 5000, [worker()], worker(), ("local", "never")),
    ("auto", 5000, [], worker(), ("local", "no_prefill_worker")),
    ("auto", 512, [worker()], worker(), ("local", "short")),
    ("auto", 513, [worker()], worker(), ("remote", "long")),
    ("auto", 5000, [worker(4), worker(6)], worker(), ("local", "prefill_busy")),
    ("auto", 5000, [worker(4)], worker(prefilling=4), ("remote", "long")),
    ("auto", 5000, [worker(3), worker(9)], worker(), ("remote", "long")),
])
def test_the_policy_decides_from_the_uncached_length_and_the_queues(mode, uncached, prefill, decode, expected):
    d = DisaggPolicy(mode, local_tokens=512, prefill_queue=4).decide(uncached, prefill, decode)
    assert (d.where, d.reason) == expected


@pytest.mark.parametrize("prefill,wait_ms,expected", [
    ([worker(1, wait_ms=600.0), worker(1, wait_ms=550.0)], 500.0, ("local", "prefill_busy", 550.0)),
    ([worker(9, wait_ms=120.0)], 500.0, ("remote", "long", 120.0)),  # many prompts in flight, but short ones
    ([worker(9, wait_ms=120.0), worker(4, wait_ms=None)], 500.0, ("local", "prefill_busy", None)),  # no time: count
    ([worker(2, wait_ms=900.0)], 0.0, ("remote", "long", None)),  # 0: the count alone
])
def test_busy_is_the_wait_behind_the_prompts_in_flight_once_the_workers_report_times(prefill, wait_ms, expected):
    d = DisaggPolicy("auto", local_tokens=512, prefill_queue=4, prefill_wait_ms=wait_ms).decide(5000, prefill,
                                                                                                worker())
    assert (d.where, d.reason, d.wait_ms) == expected


@pytest.mark.parametrize("decode,expected", [
    (worker(28), ("local", "prefill_busy", 430.1)),  # 28 rows each wait 512 x 0.03 ms: less than the 600 ms queue
    (worker(40), ("remote", "decode_busy", 614.4)),  # 40 rows: more
    (worker(22, local_tokens=[10_000]), ("remote", "decode_busy", 622.6)),  # its own prompts' 300 ms, 21 rows
    (worker(22, wait_ms=0.0, per_token=0.06), ("remote", "decode_busy", 675.8)),  # its own time a token: 0.06
    (worker(0, local_tokens=[19_000]), ("local", "prefill_busy", 570.0)),  # no rows: the shorter queue
])
def test_a_busy_prefill_queue_goes_local_only_where_the_decode_workers_cost_is_lower(decode, expected):
    """The decode worker's cost of a local 512-token prompt: its local prompts ahead at its time a token (the
    prefill worker's, 0.03, until it has one) plus the prompt's compute once for each of its decoding rows."""
    prefill = [worker(6, wait_ms=600.0, per_token=0.03)]
    d = DisaggPolicy("auto", local_tokens=256, prefill_wait_ms=500).decide(512, prefill, decode)
    assert (d.where, d.reason, d.wait_ms) == expected[:2] + (pytest.approx(600.0),)
    assert d.local_ms == pytest.approx(expected[2], abs=0.1)


def serving(rows=8, slo=10.0, fixed=None, per_token=None, base=None, prompt_per_token=None, cap=None):
    """A decode worker with ``rows`` decoding, serving a TPOT SLO, with its step times as its info reports them."""
    w = worker(rows)
    w.info.update(slo_tpot_ms=slo, mixed_step_fixed_ms=fixed, step_ms_per_prompt_token=per_token, step_base_ms=base,
                  step_prefill_cap=cap)
    if prompt_per_token is not None:
        w.info["step_times"] = {"prompt_ms_per_token": prompt_per_token}
    return w


@pytest.mark.parametrize("decode,expected", [
    (serving(fixed=12.0, per_token=0.01), ("remote", "tpot_slo")),  # a mixed step breaks the SLO at any chunk
    (serving(fixed=3.0, per_token=0.01), ("local", "short")),  # 3 + 0.01 x 400 = 7 ms: within 10
    (serving(fixed=3.0, per_token=0.03), ("remote", "tpot_slo")),  # 15 ms
    (serving(fixed=3.0, per_token=0.03, cap=128), ("local", "short")),  # chunks of 128: 6.8 ms
    (serving(base=5.0, prompt_per_token=0.02), ("remote", "tpot_slo")),  # no fit yet: 5 + 8 ms
    (serving(base=5.0, prompt_per_token=0.01), ("local", "short")),  # 9 ms
    (serving(), ("local", "short")),  # nothing timed yet: as far as is known it fits
    (serving(rows=0, fixed=12.0, per_token=0.01), ("local", "short")),  # nothing decodes there to stall
    (serving(slo=None, fixed=12.0, per_token=0.01), ("local", "short")),  # no SLO served
])
def test_a_short_prompt_stays_remote_where_its_step_would_break_the_tpot_slo(decode, expected):
    d = DisaggPolicy("auto", local_tokens=512).decide(400, [worker()], decode)
    assert (d.where, d.reason) == expected


def test_a_short_prompt_that_would_break_the_slo_still_goes_local_without_a_prefill_worker():
    d = DisaggPolicy("auto", local_tokens=512).decide(400, [], serving(fixed=12.0, per_token=0.01))
    assert (d.where, d.reason) == ("local", "no_prefill_worker")


def test_the_local_cost_counts_each_chunks_fixed_cost_once_for_every_decoding_row():
    """1,024 tokens in chunks of 256: 4 chunks, each 6 ms beyond a 4 ms decode step, for each of 10 rows."""
    decode = serving(rows=10, fixed=10.0, per_token=0.01, base=4.0, cap=256, prompt_per_token=0.02)
    assert DisaggPolicy.local_cost_ms(1024, decode, 0.05) == pytest.approx(10 * (1024 * 0.02 + 4 * 6.0))
    decode.info.update(mixed_step_fixed_ms=None)  # no fit: the compute alone
    assert DisaggPolicy.local_cost_ms(1024, decode, 0.05) == pytest.approx(10 * 1024 * 0.02)


def test_a_prefill_workers_wait_is_its_tokens_in_flight_at_its_own_time_a_token():
    w = WorkerClient("tcp://127.0.0.1:1", "prefill", {})
    assert w.prefill_wait_ms() is None  # no prompt step yet
    w.info = {"step_times": {"prompt_ms_per_token": 0.03}}
    w.prompt_tokens_out.update(a=5000, b=15_000)
    assert w.prefill_wait_ms() == pytest.approx(600.0)


def test_the_prompt_time_a_token_is_over_the_recent_prompt_steps():
    from engine.step_budget import RECENT_PROMPT_STEPS, StepLog

    log = StepLog()
    assert log.info()["prompt_ms_per_token"] is None
    log.add(StepRecord(0, 600, 5_000.0))  # the first, cold: left out
    log.add(StepRecord(4, 0, 5.0))  # decode-only steps do not count
    assert log.prompt_ms_per_token() is None
    log.add(StepRecord(0, 500, 100.0))
    assert log.prompt_ms_per_token() == pytest.approx(0.2)
    for _ in range(3):
        log.add(StepRecord(0, 1000, 30.0))
    assert log.prompt_ms_per_token() == pytest.approx(0.03)  # the median: one slow step barely moves it
    for _ in range(RECENT_PROMPT_STEPS):
        log.add(StepRecord(0, 1000, 40.0))
    assert log.info()["prompt_ms_per_token"] == pytest.approx(0.04)


def test_bad_disagg_settings_are_refused():
    with pytest.raises(ValueError, match="disagg"):
        RouterConfig(decode=["tcp://127.0.0.1:1"], prefill=["tcp://127.0.0.1:2"], disagg="sometimes")
    with pytest.raises(ValueError, match="prefill worker"):
        RouterConfig(decode=["tcp://127.0.0.1:1"])
    assert RouterConfig(decode=["tcp://127.0.0.1:1"], disagg="never").disagg == "never"
    with pytest.raises(ValueError, match="step_prefill_tokens"):
        EngineConfig(step_prefill_tokens=0)


@pytest.fixture(scope="module")
def pair():
    clusters = [Cluster("--disagg", "auto", "--disagg-local-tokens", "64", "--step-prefill-tokens", "16"),
                Cluster("--colocated")]
    try:
        yield [c.wait_ready() for c in clusters]
    finally:
        for c in clusters:
            c.stop()


def complete(url: str, prompt: str, max_tokens: int = 12):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})


def decode_workers(cluster) -> list[dict]:
    return httpx.get(cluster.url + "/health").json()["workers"]["decode"]


def decode_info(cluster) -> dict:
    """What the decode worker reported in its last pong (the router's /health)."""
    return httpx.get(cluster.url + "/health").json()["workers"]["decode"][0]


def test_auto_prefills_short_prompts_locally_and_long_ones_remotely_with_the_colocated_tokens(pair):
    auto, colocated = pair
    short, long = "Hello there", "a long prompt for the prefill worker " * 6
    for prompt, where, reason in ((short, "local", "short"), (long, "remote", "long")):
        got, want = complete(auto.url, prompt), complete(colocated.url, prompt)
        assert got.choices[0].text == want.choices[0].text
        block = got.model_extra["pdserve"]
        assert (block["disagg"], block["disagg_reason"]) == (where, reason)
        assert (block["kv_bytes"] > 0) == (where == "remote")
    metrics = httpx.get(auto.url + "/metrics").text
    assert 'pdserve_disagg_requests_total{reason="short",where="local"} 1.0' in metrics
    assert 'pdserve_disagg_requests_total{reason="long",where="remote"} 1.0' in metrics


def test_local_prefill_next_to_a_decoding_stream_keeps_to_the_step_cap(pair):
    auto, colocated = pair
    decoding, enough, ended = threading.Event(), threading.Event(), threading.Event()

    def stream_on():  # decodes until told to stop (it closes the stream): the prompt below always meets it
        client = openai.OpenAI(base_url=auto.url + "/v1", api_key="none")
        with client.completions.create(model="tiny-llama", prompt="stream on", max_tokens=1000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as events:
            for _ in events:
                decoding.set()
                if enough.is_set():
                    return
        ended.set()  # all 1000 tokens out: the condition below was not arranged after all

    stream = threading.Thread(target=stream_on)
    stream.start()
    try:
        assert decoding.wait(60)  # the prompt below arrives while this stream decodes
        prompt = "x" * 60  # 62 tokens: local, in chunks of 16 next to the decoding stream
        got = complete(auto.url, prompt).choices[0].text
        assert not ended.is_set(), "the stream ended before the local prompt was computed"
    finally:
        enough.set()
        stream.join(120)
    assert got == complete(colocated.url, prompt).choices[0].text
    # the worker's report (its pong) that follows the local prompt's steps: an earlier one can hold neither
    assert eventually(lambda: decode_info(auto)["mixed_steps"] >= 1, 10, 0.1), decode_info(auto)
    decode = decode_info(auto)
    assert decode["local_prefills"] >= 2 and decode["step_prefill_cap"] == 16
    assert decode["mixed_steps"] >= 1 and 0 < decode["step_prompt_tokens_max"] <= 16


def test_a_prefill_worker_counts_prompts_not_the_streams_it_handed_on(pair):
    """Streams prefilled remotely leave the prefill worker's count once their first token is out: with more of
    them decoding than ``--disagg-prefill-queue`` (4), a long prompt still goes remote (it once went local as
    ``prefill_busy``, the decode workers then prefilling long prompts between their steps)."""
    auto, colocated = pair
    long = "a long prompt for the prefill worker " * 6
    started, done = [threading.Event() for _ in range(5)], threading.Event()

    def stream_on(i):  # decodes until the test is done with it (at most 780 tokens)
        client = openai.OpenAI(base_url=auto.url + "/v1", api_key="none")
        with client.completions.create(model="tiny-llama", prompt=f"{i} {long}", max_tokens=780, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as stream:
            for _ in stream:
                started[i].set()
                if done.is_set():
                    break

    with ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(stream_on, i) for i in range(5)]
        assert all(e.wait(60) for e in started), [f.exception(0.1) for f in streams if f.done()]

        def busy():
            workers = httpx.get(auto.url + "/health").json()["workers"]
            return [w["outstanding"] for w in workers["prefill"]], [w["outstanding"] for w in workers["decode"]]

        # the prompts are done and at least 4 streams decode (the last KV may still be on its way: wait for it)
        assert eventually(lambda: busy()[0] == [0] and busy()[1][0] >= 4, 30, 0.05), busy()
        got = complete(auto.url, "another " + long)
        done.set()
        for f in streams:
            f.result(120)
    block = got.model_extra["pdserve"]
    assert (block["disagg"], block["disagg_reason"]) == ("remote", "long")
    assert block["disagg_wait_ms"] == 0.0  # the worker's times are known, and nothing waits there
    assert got.choices[0].text == complete(colocated.url, "another " + long).choices[0].text
    prefill = httpx.get(auto.url + "/health").json()["workers"]["prefill"][0]
    assert prefill["outstanding"] == 0
    assert eventually(lambda: busy()[1] == [0], 30, 0.05), busy()  # the streams closed early end there too


def test_never_with_no_prefill_worker_serves_from_the_decode_workers():
    cluster = Cluster("--prefill", "0", "--disagg", "never").wait_ready()
    try:
        got = complete(cluster.url, "Hello there")
        assert got.choices[0].text and got.model_extra["pdserve"]["disagg"] == "local"
        assert eventually(lambda: decode_info(cluster)["local_prefills"] == 1, 5, 0.1)
    finally:
        cluster.stop()


def test_mixed_workers_prefill_for_each_other_with_the_colocated_tokens(pair):
    _, colocated = pair
    cluster = Cluster("--prefill", "0", "--decode", "0", "--mixed", "2").wait_ready()
    try:
        assert eventually(lambda: all(w["healthy"] for w in decode_workers(cluster)), 10, 0.1)
        prompts = [f"mixed worker prompt {i} " * (i + 1) for i in range(6)]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: complete(cluster.url, p, 24), prompts))
        for prompt, out in zip(prompts, got):
            assert out.choices[0].text == complete(colocated.url, prompt, 24).choices[0].text
        blocks = [out.model_extra["pdserve"] for out in got]
        # prefilled on the other worker and the KV moved; on a loaded machine the other can be out of the picks
        # for a moment (a late pong), and the prompt is then prefilled where it decodes
        assert all(b["kv_bytes"] > 0 or b["disagg_reason"] == "same_worker" for b in blocks)
        assert sum(b["kv_bytes"] > 0 for b in blocks) >= 3, blocks
        health = httpx.get(cluster.url + "/health").json()["workers"]
        assert {w["address"] for w in health["prefill"]} == {w["address"] for w in health["decode"]}
        assert eventually(lambda: all(w["role"] == "mixed" for w in decode_workers(cluster))
                          and sum(w["prefilled_for_others"] for w in decode_workers(cluster)) >= 3, 5, 0.1)
    finally:
        cluster.stop()


def test_one_mixed_worker_alone_prefills_its_own_prompts(pair):
    _, colocated = pair
    cluster = Cluster("--prefill", "0", "--decode", "0", "--mixed", "1").wait_ready()
    try:
        got = complete(cluster.url, "alone")
        assert got.choices[0].text == complete(colocated.url, "alone").choices[0].text
        assert (got.model_extra["pdserve"]["disagg"], got.model_extra["pdserve"]["disagg_reason"]) == \
            ("local", "same_worker")
    finally:
        cluster.stop()
