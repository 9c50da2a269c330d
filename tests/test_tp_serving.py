"""Serving with tensor-parallel groups on the CPU (gloo ranks as processes): ``pdserve up`` with prefill and decode
groups of different sizes, over tcp and shm, streams the tokens of the one-device reference, four at once; a
decode group that loses a rank fails its own streams within 5 s while the other group's finish, and comes back."""
import os
import re
import signal
import time

import httpx
import pytest

from deploy.local import Cluster
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from tests.streams import StreamClient, started
from tests.test_failures import LONG, eventually
from tests.test_retry import all_back, health

PROMPTS = ["Hello there", "The quick brown fox jumps over", "tensor parallel " * 6, "a b c d e f g"]
TOKENS = 16


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = Engine(EngineConfig(threads=1))
    out = generate_many(engine, [engine.tokenizer.encode(p) for p in PROMPTS],
                        [SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True) for _ in PROMPTS])
    return [seq.output_ids for _, seq in out]


def streams_of_the_reference(url: str, reference: list) -> list:
    """The four prompts streamed at once through ``url``; asserts their tokens are the reference's."""
    bodies = [{"model": "tiny-llama", "prompt": p, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
              for p in PROMPTS]
    clients = started([StreamClient(url, b) for b in bodies])
    for c in clients:
        c.join(120)
    assert [c.error for c in clients] == [None] * 4
    assert [c.ids for c in clients] == reference
    return clients


@pytest.mark.parametrize("transport,prefill_tp,decode_tp", [
    ("tcp", 2, 2), ("shm", 2, 1), ("shm", 1, 2), ("shm", 2, 2),
    ("arrow", 1, 2), ("nixl", 2, 1), ("pickle", 2, 2), ("nccl", 2, 1), ("nccl", 1, 2),
], ids=lambda v: str(v))
def test_up_with_groups_of_any_tp_streams_the_reference(reference, transport, prefill_tp, decode_tp):
    gloo = ("--kv-option", "nccl_backend=gloo", "--device", "cpu") if transport == "nccl" else ()  # nccl's protocol
    cluster = Cluster("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--transport", transport, *gloo)
    try:
        cluster.wait_ready()
        kv = streams_of_the_reference(cluster.url, reference)[0].pdserve
        assert kv["transport"] == transport and kv["kv_bytes"] == 2 * 4 * 2 * 16 * 4 * (len(PROMPTS[0]) + 1)
        if decode_tp == 2:  # each rank's own wire time, in the response and in Prometheus
            assert len(kv["kv_ranks"]) == 2 and all(r["bytes"] > 0 for r in kv["kv_ranks"])
            metrics = httpx.get(cluster.url + "/metrics").text
            assert re.search(r'pdserve_kv_transfer_rank_wire_seconds_count\{[^}]*rank="1"', metrics)
        workers = health(cluster.url)["workers"]
        assert [w.get("tp", 1) for w in workers["prefill"] + workers["decode"]] == [prefill_tp, decode_tp]
        assert eventually(lambda: all_back(cluster.url), 30, 0.5)
    finally:
        cluster.stop()


def test_a_decode_group_that_loses_a_rank_has_its_streams_go_on_on_the_other_and_comes_back():
    cluster = Cluster("--decode", "2", "--decode-tp", "2").wait_ready()
    try:
        clients = started([StreamClient(cluster.url, LONG) for _ in range(4)])
        for c in clients:
            c.wait_tokens(3)
        victim = max(health(cluster.url)["workers"]["decode"], key=lambda w: w["outstanding"])  # the router's count
        on_victim = victim["outstanding"]
        os.kill(victim["rank_pids"][0], signal.SIGKILL)
        for c in clients:
            c.join(120)
        # the group gives its requests up and restarts; their streams go on on the other group from their last token
        assert all(c.finished and not c.error and c.tokens == LONG["max_tokens"] for c in clients), \
            [(c.tokens, c.error) for c in clients]
        assert all(c.ids == clients[0].ids for c in clients) and on_victim >= 1
        metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
        assert f'pdserve_request_retries_total{{reason="decode_unavailable"}} {float(on_victim)}' in metrics
        assert eventually(lambda: all_back(cluster.url), 90, 0.5)  # `up` restarted the group as a unit
        again = httpx.post(cluster.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert again.status_code == 200
        restarted = [w for w in health(cluster.url)["workers"]["decode"] if w["pid"] != victim["pid"]]
        assert any(w["restarts"] >= 1 and w["tp"] == 2 for w in restarted)
    finally:
        cluster.stop()


def test_a_tp_group_steps_ahead_and_a_lost_rank_mid_step_fails_its_streams(reference):
    """``--decode-graphs eager`` (the fixed-shape decode step without CUDA graphs) turns the step ahead on here too:
    the TP=2 decode group streams the reference four at once with steps launched before the last one's tokens were
    read; a rank killed while it steps ends the streams within 5 s and the group comes back."""
    cluster = Cluster("--decode-tp", "2", "--decode-graphs", "eager", "--retries", "0").wait_ready()  # (with
    # retries, a stream whose group lost a rank would go on once the group is back, were it back within --retry-wait)
    try:
        streams_of_the_reference(cluster.url, reference)
        decode = health(cluster.url)["workers"]["decode"][0]
        assert eventually(lambda: health(cluster.url)["workers"]["decode"][0]["steps_ahead"] > 0, 10, 0.2)
        clients = started([StreamClient(cluster.url, LONG) for _ in range(2)])
        for c in clients:
            c.wait_tokens(3)
        os.kill(decode["rank_pids"][0], signal.SIGKILL)
        killed_at = time.monotonic()
        for c in clients:
            c.join(120)
        assert all(c.error and c.ended_at - killed_at <= 5 for c in clients), [c.error for c in clients]
        # at once: the group said it is going (draining), so no request is sent to it: the router waits for the
        # restart (PICK_WAIT_S) and answers, or says when to come back
        at_once = httpx.post(cluster.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert at_once.status_code == 200 or (at_once.status_code == 503 and at_once.headers.get("retry-after")), \
            at_once.text
        assert eventually(lambda: all_back(cluster.url), 90, 0.5)
        assert health(cluster.url)["workers"]["decode"][0]["restarts"] >= 1
        again = httpx.post(cluster.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert again.status_code == 200, again.text
    finally:
        cluster.stop()


def test_prefill_and_decode_of_different_models_are_a_clear_error(tmp_path):
    from tests.fleet import Fleet
    from tests.test_paged_engine import write_family

    other = write_family(tmp_path / "other", "qwen3")
    fleet = Fleet()
    try:
        fleet.worker("p", "prefill", "--tp", "2")
        fleet.worker("d", "decode", "--model", other)
        fleet.router()
        fleet.wait_healthy()
        problems = fleet.health()["problems"]
        assert len(problems) == 1 and "serve different models" in problems[0] and "--model" in problems[0]
        r = httpx.post(fleet.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 500 and "start both roles with the same --model" in r.json()["error"]["message"]
        assert fleet.health()["workers"]["prefill"][0]["healthy"]  # and the workers keep serving
    finally:
        fleet.stop()


def test_the_eight_gpu_layouts_hand_kv_between_groups_of_four_and_two_on_the_cpu(reference):
    """Issue 32's run 4 (``bench.tp_handoff.cross_tp`` over ``LAYOUTS8``, without their ``--gpus``) at the tiny
    model's scale in fp32 (nccl's protocol over gloo, 2 KV heads: a group of four holds each head twice): a prefill
    group of TP=4 hands its KV to two decode groups of TP=2, and two prefill groups of TP=2 to one decode group of
    TP=4. Both follow colocated TP=4 and TP=1 token for token, logprobs within fp32 rounding; streamed at once twice
    (with two groups on a side, the router's picks reach both) they give the reference, every group takes part, and
    each decode rank reports its own slice."""
    from bench.tp_handoff import LAYOUTS8, cross_tp

    shape = ["--dtype", "float32", "--device", "cpu", "--kv-option", "nccl_backend=gloo"]
    layouts = {name: args[:args.index("--gpus")] for name, args in LAYOUTS8.items()}
    refs = {"colocated-tp4": ["--colocated", "--tp", "4"], "colocated-tp1": ["--colocated"]}
    checked = []

    def groups_take_part(url: str, name: str) -> None:
        layout = layouts[name]
        decode_tp = int(layout[layout.index("--decode-tp") + 1])
        for _ in range(2):
            for c in streams_of_the_reference(url, reference):
                assert len(c.pdserve["kv_ranks"]) == decode_tp and all(r["bytes"] > 0 for r in c.pdserve["kv_ranks"])
        workers = health(url)["workers"]
        assert [w["tp"] for w in workers["prefill"]] == [int(layout[3])] * int(layout[1])
        assert [w["tp"] for w in workers["decode"]] == [decode_tp] * int(layout[5])
        assert all(w["prefix_prompt_tokens"] > 0 for w in workers["prefill"]), workers["prefill"]
        assert all(w["completed"] > 0 for w in workers["decode"]), workers["decode"]
        assert eventually(lambda: all_back(url), 30, 0.5)
        checked.append(name)

    out = cross_tp(shape, "tiny-llama", refs, layouts, "nccl", tokens=8, prompts=PROMPTS, check=groups_take_part)
    assert checked == list(layouts)
    checks = [out["references"]["colocated-tp1"]] + [out[name][ref] for name in layouts for ref in refs]
    assert len(checks) == 5
    for c in checks:
        assert c["tokens_agreeing_before_first_difference"] == [8] * len(PROMPTS), out
        assert c["max_abs_logprob_delta_while_agreeing"] < 1e-3, out
