"""A dead worker costs no request: ``pdserve up`` with one worker SIGKILLed, then requests at once; requests in flight
on a killed prefill or colocated worker run again elsewhere, streams go on from their last token; a half-minute
chaos run. And the piece a retry after the first token rests on: a sequence resumed from its first token goes on
exactly as the uninterrupted one."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deploy.local import Cluster, children_of
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from engine.requests import resumed_sequence
from tests.checkpoints import SLOW, write_checkpoint
from tests.streams import StreamClient, started
from tests.test_failures import LONG, SHORT, eventually

EIGHT = 8


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("slow"), SLOW)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def at_once(url: str, body: dict, n: int = EIGHT) -> list[int]:
    """``n`` requests sent together; their status codes (with the start of the body where not 200)."""
    def one(_):
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        return 200 if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def all_back(url: str) -> bool:
    h = health(url)
    return all(w["healthy"] and w["kv_blocks_free"] == w["kv_blocks"] for ws in h["workers"].values() for w in ws) \
        and h["admission"] == {"queued": 0, "in_flight": 0, "reserved": 0}


def test_up_decode_killed_then_eight_requests_at_once_all_succeed_and_its_streams_go_on(slow_model):
    """The streams decode on the slow model (seconds for 900 tokens), so all four are still on their workers when
    one is killed, whatever else the machine runs."""
    model = slow_model.rsplit("/", 1)[1]
    cluster = Cluster("--model", slow_model, "--decode", "2").wait_ready()
    try:
        clients = started([StreamClient(cluster.url, {**LONG, "model": model}) for _ in range(4)])
        for c in clients:
            c.wait_tokens(3)
        # the router's own count of the streams on each worker (a worker's "active" comes with its next heartbeat)
        victim = max(health(cluster.url)["workers"]["decode"], key=lambda w: w["outstanding"])
        on_victim = victim["outstanding"]
        assert not any(c.ended_at for c in clients), "a stream ended before the kill"
        os.kill(victim["pid"], signal.SIGKILL)
        assert at_once(cluster.url, {**SHORT, "model": model}) == [200] * EIGHT
        for c in clients:
            c.join(180)
        # the victim's streams go on on the other worker from their last token: every stream ends whole, one text
        assert all(c.finished and not c.error and c.tokens == LONG["max_tokens"] for c in clients), \
            [(c.tokens, c.error) for c in clients]
        assert all(c.ids == clients[0].ids for c in clients) and on_victim >= 1
        # the victim's streams were retried, and so was any of the eight the router sent it before it saw it gone
        metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
        retried = re.search(r'pdserve_request_retries_total\{reason="decode_lost"\} ([0-9.]+)', metrics)
        assert retried and on_victim <= float(retried[1]) <= on_victim + EIGHT, metrics
        assert eventually(lambda: all_back(cluster.url), 60, 0.5)  # `up` restarted it
    finally:
        cluster.stop()


def test_the_only_decode_worker_killed_the_next_request_waits_for_its_restart():
    """One decode worker: a request right after its SIGKILL waits (``--retry-wait``) for ``up`` to restart it and
    succeeds, where the default 3 s is about a restart's time on two cores."""
    cluster = Cluster("--retry-wait", "60").wait_ready()
    try:
        router = [pid for pid in children_of(cluster.proc.pid) if "router" in open(f"/proc/{pid}/cmdline").read()]
        assert "--retry-wait\x0060.0\x00" in open(f"/proc/{router[0]}/cmdline").read()
        victim = health(cluster.url)["workers"]["decode"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        r = httpx.post(cluster.url + "/v1/completions", json={**SHORT, "max_tokens": 4}, timeout=90)
        assert r.status_code == 200, r.text
        back = health(cluster.url)["workers"]["decode"][0]
        assert back["pid"] != victim["pid"] and back["restarts"] == 1
    finally:
        cluster.stop()


def kill_busy(url: str, role: str, busy: str) -> dict:
    """SIGKILL a worker of ``role`` that has work in hand (``busy``: the counter that says so)."""
    victim = None
    end = time.monotonic() + 30
    while victim is None and time.monotonic() < end:
        victim = next((w for w in health(url)["workers"][role] if w.get(busy)), None)
        time.sleep(0.02)
    assert victim is not None, f"no {role} worker got busy"
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


@pytest.mark.parametrize("up_args,role,busy", [
    (("--prefill", "2", "--decode", "2"), "prefill", "prefilling"),
    (("--colocated", "--decode", "2"), "colocated", "active"),
], ids=["prefill", "colocated"])
def test_up_worker_killed_with_prompts_in_hand_they_and_eight_more_all_succeed(slow_model, up_args, role, busy):
    model = slow_model.rsplit("/", 1)[1]
    body = {"model": model, "prompt": "x" * 2500, "max_tokens": 4, "ignore_eos": True}
    cluster = Cluster("--model", slow_model, *up_args).wait_ready()
    try:
        clients = started([StreamClient(cluster.url, body) for _ in range(4)])
        kill_busy(cluster.url, role, busy)
        assert at_once(cluster.url, {**body, "prompt": "hello"}) == [200] * EIGHT
        for c in clients:
            c.join(120)
        assert all(c.finished and not c.error and c.tokens == 4 for c in clients), [c.error for c in clients]
        assert sum(c.pdserve["retries"] for c in clients) >= 1
        metrics = httpx.get(cluster.url + "/metrics").text
        assert f'pdserve_request_retries_total{{reason="{role}_lost"}}' in metrics
        assert eventually(lambda: all_back(cluster.url), 60, 0.5)
    finally:
        cluster.stop()


def test_a_sequence_resumed_from_its_first_token_goes_on_as_the_whole_one():
    engine = Engine(EngineConfig(model="tiny-llama", threads=1))
    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    _, whole = generate_many(engine, [prompt], [params])[0]
    seq = resumed_sequence(engine, "r", prompt, whole.output_ids[0], 0, params.to_dict())
    engine.add(seq)  # no KV: prompt and first token are computed again, as a colocated retry does
    while not seq.finished:
        engine.step()
    assert seq.output_ids == whole.output_ids


def test_half_a_minute_of_chaos_loses_no_request(tmp_path):
    # the ten-minute run is bench/results/chaos-10min.*; here a worker dies every 7 s
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "bench", "chaos",
                           "--duration", "36", "--kill-every", "7", "--streams", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert report["failed_before_first_byte"] == report["failed_mid_stream"] == 0 and report["ok"] > 40
    assert sum(1 for k in report["kills"] if "pid" in k) >= 3  # each waits for the last victim's restart
    assert report["leaked_blocks"] == 0 and all(b["healthy_at_end"] for b in report["kv_blocks"])
    assert max(g for g in report["rss_growth_pct"].values() if g is not None) < 5


def test_a_stream_whose_worker_is_lost_resumes_after_the_clients_last_token_and_a_stalled_one_does_not():
    from router.retry import RequestRun, WorkerFailure

    run = RequestRun("r", {}, 0.0)
    run.first = {"token": 5, "prompt_ids": [1, 2, 3], "emitted": 2, "params": {"max_tokens": 9}}
    run.output_ids, run.emitted, run.streamed = [6, 7], 4, True
    assert run.resume_state() == {"token": 7, "earlier": [5, 6], "prompt_ids": [1, 2, 3], "emitted": 6,
                                  "params": {"max_tokens": 9}}
    lost = WorkerFailure({"status": 502, "message": "gone", "lost": True}, None)
    rank = WorkerFailure({"status": 503, "message": "rank died", "stage": "tp_rank_lost"}, None)
    stalled = WorkerFailure({"status": 504, "message": "stalled", "stalled": True}, None)
    full = WorkerFailure({"status": 503, "message": "KV budget full"}, None)
    assert run.may_retry(lost, 2) and run.may_retry(rank, 2)
    assert not run.may_retry(stalled, 2) and not run.may_retry(full, 2) and not run.may_retry(lost, 0)
    run.streamed = False  # before decode streamed: any retryable failure runs again
    assert run.may_retry(stalled, 2) and run.may_retry(full, 2)
