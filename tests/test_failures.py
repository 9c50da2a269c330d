"""Reliability with real processes: workers killed, stopped and restarted, the router
restarted, clients disconnecting, graceful shutdown. Every request ends with tokens or
an error, in bounded time, and nothing stays reserved."""
import re
import signal
import time

import httpx
import pytest

from tests.checkpoints import SLOW, write_checkpoint
from tests.fleet import Fleet
from tests.streams import StreamClient

LONG = {"model": "tiny-llama", "prompt": "Tell me a story", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
SHORT = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 8, "temperature": 0}


def complete(url, body=SHORT, timeout=60):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def eventually(check, timeout=5.0, every=0.05):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > end:
            return value
        time.sleep(every)


def decode_is_clean(fleet, name):
    info = fleet.worker_info(name)
    return info["active"] == 0 and info["waiting"] == 0 and info["kv_reserved_bytes"] == 0 \
        and info["kv_pool_bytes_in_use"] == 0 and info["kv_blocks_free"] == info["kv_blocks"]


def prefill_is_clean(fleet, name):
    info = fleet.worker_info(name)
    return info["kv_held_bytes"] == 0 and info["prefilling"] == 0 and info["kv_blocks_free"] == info["kv_blocks"]


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("slow"), SLOW)


def two_decodes() -> Fleet:
    """A started fleet: one prefill, decode workers d1 and d2, a round-robin router."""
    f = Fleet()
    try:
        f.worker("p", "prefill")
        f.worker("d1", "decode")
        f.worker("d2", "decode")
        f.router("--policy", "round_robin")
        f.wait_healthy()
    except BaseException:
        f.__exit__(None, None, None)
        raise
    return f


def retries(url: str, reason: str) -> float:
    found = re.search(rf'pdserve_request_retries_total{{reason="{reason}"}} (\S+)', httpx.get(url + "/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_decode_killed_mid_stream_its_streams_go_on_on_the_other_with_the_same_tokens():
    with two_decodes() as f:
        clients = [StreamClient(f.url, LONG) for _ in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.wait_tokens(3)
        assert all(c.tokens < LONG["max_tokens"] for c in clients)  # every stream is still going
        f.signal("d1", signal.SIGKILL)
        for c in clients:
            c.join(60)
        assert all(c.finished and not c.error and c.tokens == LONG["max_tokens"] for c in clients), \
            [(c.tokens, c.error) for c in clients]
        assert all(c.ids == clients[0].ids and c.text == clients[0].text for c in clients)  # greedy: one text
        assert retries(f.url, "decode_lost") == 2  # round robin: two of the four were on d1, resumed on d2

        assert [complete(f.url).status_code for _ in range(4)] == [200] * 4
        f.restart("d1")
        f.wait_healthy(["d1"])
        assert [complete(f.url).status_code for _ in range(4)] == [200] * 4
        assert eventually(lambda: f.worker_info("d1")["completed"] >= 2)


def test_prefill_killed_mid_prefill_is_retried_on_the_other(slow_model):
    model = slow_model.rsplit("/", 1)[1]
    with Fleet("--model", slow_model) as f:
        f.worker("p1", "prefill")
        f.worker("p2", "prefill")
        f.worker("d", "decode")
        f.router("--policy", "round_robin")
        f.wait_healthy()
        victim = StreamClient(f.url, {"model": model, "prompt": "x" * 3000, "max_tokens": 4})
        victim.start()
        assert eventually(lambda: f.worker_info("p1")["queued"] == 0 and victim.tokens == 0 and victim.ended_at is None, 2)
        time.sleep(0.3)
        assert victim.tokens == 0, "prefill finished before the kill; the prompt is too short for this machine"
        f.signal("p1", signal.SIGKILL)
        victim.join(60)
        assert not victim.error and victim.finished and victim.tokens == 4, victim.error
        assert victim.pdserve["retries"] == 1 and victim.pdserve["retry_reasons"] == ["prefill_lost"]
        assert eventually(lambda: decode_is_clean(f, "d"))
        r = complete(f.url, {"model": model, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert f.health()["admission"]["in_flight"] == 0


def test_prefill_killed_right_after_first_token_ends_cleanly():
    with Fleet() as f:
        f.pair()
        client = StreamClient(f.url, {**LONG, "prompt": "y" * 600, "max_tokens": 400})
        client.start()
        client.wait_tokens(1, timeout=30)
        killed_at = time.monotonic()
        f.signal("p", signal.SIGKILL)
        client.join(30)
        assert client.ended_at - killed_at < 25  # the retry's wait for a prefill worker, not a 30 s KV timeout
        assert client.finished or client.error
        assert eventually(lambda: decode_is_clean(f, "d"), 10)


def test_stalled_decode_times_out_and_prefill_frees_the_kv():
    with Fleet() as f:
        f.pair(prefill=("--kv-timeout", "1.5"))
        f.signal("d", signal.SIGSTOP)
        try:
            started = time.monotonic()
            r = complete(f.url, {**SHORT, "prompt": "z" * 600}, timeout=30)
            assert r.status_code in (502, 503, 504), r.text
            # the push gives up after --kv-timeout (1.5 s); the retries wait for a decode worker (--retry-wait, 3 s)
            # until the stopped one is dead to the router (3 s without a pong): an error in seconds, not the 30 s
            assert time.monotonic() - started < 12
        finally:
            f.signal("d", signal.SIGCONT)
        f.wait_healthy(["d"], timeout=10)
        assert eventually(lambda: prefill_is_clean(f, "p") and f.worker_info("p")["pushing"] == 0, 10)
        assert eventually(lambda: decode_is_clean(f, "d"), 10)
        assert complete(f.url).status_code == 200


@pytest.mark.serial
def test_client_disconnect_aborts_and_frees_within_a_second():
    with Fleet() as f:
        f.pair(router=("--heartbeat", "0.1"))
        with httpx.stream("POST", f.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            assert eventually(lambda: f.worker_info("d")["active"] == 1, 1)
        closed_at = time.monotonic()
        assert eventually(lambda: decode_is_clean(f, "d") and f.health()["admission"]["in_flight"] == 0, 1.0)
        assert time.monotonic() - closed_at < 1.0
        metrics = httpx.get(f.url + "/metrics").text
        assert "pdserve_requests_in_flight 0.0" in metrics
        assert 'pdserve_worker_active_sequences{role="decode"' in metrics


@pytest.mark.serial
def test_non_stream_client_that_gives_up_aborts_its_request():
    with Fleet() as f:
        f.pair(router=("--heartbeat", "0.1"))
        with pytest.raises(httpx.ReadTimeout):
            complete(f.url, LONG, timeout=0.6)
        gave_up = time.monotonic()
        assert eventually(lambda: decode_is_clean(f, "d") and f.health()["admission"]["in_flight"] == 0, 1.5)
        assert time.monotonic() - gave_up < 1.5
        assert f.worker_info("d")["completed"] == 0
        assert 'pdserve_errors_total{kind="client_disconnected"} 1.0' in httpx.get(f.url + "/metrics").text


def test_client_gone_before_the_first_token_leaves_no_kv_behind(slow_model):
    model = slow_model.rsplit("/", 1)[1]
    with Fleet("--model", slow_model) as f:
        f.pair(router=("--heartbeat", "0.1"))
        with pytest.raises(httpx.ReadTimeout):
            complete(f.url, {"model": model, "prompt": "x" * 2500, "max_tokens": 50}, timeout=0.3)
        assert eventually(lambda: decode_is_clean(f, "d") and f.health()["admission"]["in_flight"] == 0, 10, 0.2)
        assert eventually(lambda: prefill_is_clean(f, "p"), 10, 0.2)  # its slow prefill ends, then frees


def test_router_restart_reconnects_to_running_workers():
    with Fleet() as f:
        f.pair()
        assert complete(f.url).status_code == 200
        workers = {n: f.procs[n].pid for n in ("p", "d")}
        f.signal("router", signal.SIGKILL)
        f.router()
        f.wait_healthy()
        assert {n: f.procs[n].pid for n in ("p", "d")} == workers
        assert all(f.procs[n].poll() is None for n in workers)
        assert complete(f.url).status_code == 200


def test_sigterm_drains_in_flight_work_then_exits():
    with two_decodes() as f:
        c = StreamClient(f.url, LONG)
        c.start()
        c.wait_tokens(3)
        busy = "d1" if f.worker_info("d1")["active"] else "d2"
        f.signal(busy, signal.SIGTERM)
        assert eventually(lambda: f.worker_info(busy)["draining"], 3)
        assert [complete(f.url).status_code for _ in range(3)] == [200] * 3
        c.join(60)
        assert c.finished and not c.error and c.tokens == LONG["max_tokens"]
        assert f.procs[busy].wait(10) == 0

        c = StreamClient(f.url, LONG)
        c.start()
        c.wait_tokens(3)
        f.signal("router", signal.SIGTERM)
        c.join(60)
        assert c.finished and not c.error and c.tokens == LONG["max_tokens"]
        assert f.procs["router"].wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
