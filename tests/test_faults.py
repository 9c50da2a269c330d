"""Faults in the middle of a request, with real processes: prefill dying mid-transfer, decode dying with its KV half
landed, the data link cut mid-transfer, the router restarted under load, a straggling worker. Each request either
completes (retried on other workers, with exactly the tokens an undisturbed run gives) or ends within 5 s, and every
surviving worker's KV blocks come back.

The KV-transfer cases put a decode worker on a second "host": a network namespace behind a veth pair shaped to
2 Mbit/s, so a 900-token KV takes seconds on the wire and the fault lands mid-transfer."""
import os
import signal
import threading
import time

import httpx
import pytest

from bench.link import LinkError, RemoteHost
from control.auth import TOKEN_ENV, new_token
from tests.checkpoints import SLOW, write_checkpoint
from tests.fleet import Fleet
from tests.streams import StreamClient, started
from tests.test_failures import complete, decode_is_clean, eventually, prefill_is_clean, two_decodes

pytestmark = pytest.mark.serial  # network namespaces, and a hung worker out of the picks within 1.3 s

BIG = {"model": "tiny-llama", "prompt": "The quick brown fox. " * 43, "max_tokens": 8, "temperature": 0,
       "ignore_eos": True}


@pytest.fixture
def remote():
    try:
        with RemoteHost("2mbit") as host:
            yield host
    except LinkError as e:
        pytest.skip(str(e))


def reference_ids(url: str, body: dict) -> list[int]:
    r = complete(url, {**body, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def retried_once(client: StreamClient, body: dict, reasons: set) -> None:
    assert not client.error and client.finished, client.error
    assert client.tokens == body["max_tokens"], client.ids
    assert client.pdserve["retries"] == 1 and client.pdserve["retry_reasons"][0] in reasons, client.pdserve


def token_fleet(f: Fleet, remote: RemoteHost, prefills: tuple, decodes_here: tuple) -> Fleet:
    """Prefill workers and decode workers here, decode ``dr`` on the namespace host, a round-robin router (its
    first decode pick is ``dr``)."""
    for name in prefills:
        f.worker(name, "prefill")
    f.worker("dr", "decode", host=remote.address, wrap=remote.wrap)
    for name in decodes_here:
        f.worker(name, "decode")
    f.router("--policy", "round_robin")
    f.wait_healthy()
    return f


def test_prefill_killed_mid_transfer_is_retried_with_the_same_tokens(remote):
    with token_fleet(Fleet(env={TOKEN_ENV: new_token()}), remote, ("p1", "p2"), ()) as f:
        client = StreamClient(f.url, BIG)
        client.start()
        assert eventually(lambda: client.tokens >= 1 and any(f.worker_info(p)["pushing"] for p in ("p1", "p2")), 30)
        pushing = next(p for p in ("p1", "p2") if f.worker_info(p)["pushing"])
        f.signal(pushing, signal.SIGKILL)
        client.join(60)
        retried_once(client, BIG, {"prefill_lost", "kv_transfer"})
        survivor = "p2" if pushing == "p1" else "p1"
        assert eventually(lambda: decode_is_clean(f, "dr") and prefill_is_clean(f, survivor), 10)
        assert client.ids == reference_ids(f.url, BIG)


def landing_on(f: Fleet, name: str) -> bool:
    info = f.worker_info(name)
    return info["kv_blocks_free"] < info["kv_blocks"]


def test_decode_killed_with_kv_half_landed_is_retried_on_the_other(remote):
    with token_fleet(Fleet(env={TOKEN_ENV: new_token()}), remote, ("p",), ("d",)) as f:
        client = StreamClient(f.url, BIG)
        client.start()
        assert eventually(lambda: client.tokens >= 1 and landing_on(f, "dr"), 30)
        f.signal("dr", signal.SIGKILL)
        client.join(60)
        retried_once(client, BIG, {"decode_lost", "kv_transfer"})
        assert eventually(lambda: decode_is_clean(f, "d") and prefill_is_clean(f, "p")
                          and f.worker_info("p")["pushing"] == 0, 10)
        assert client.ids == reference_ids(f.url, BIG)


def test_link_cut_mid_transfer_retries_frees_both_sides_and_serves_after(remote):
    with token_fleet(Fleet(env={TOKEN_ENV: new_token()}), remote, ("p",), ("d",)) as f:
        client = StreamClient(f.url, BIG)
        client.start()
        assert eventually(lambda: client.tokens >= 1 and landing_on(f, "dr"), 30)
        remote.cut()
        cut_at = time.monotonic()
        try:
            client.join(60)
            retried_once(client, BIG, {"decode_lost", "kv_transfer"})
            assert client.ended_at - cut_at < 5 + 2
            # the push into the cut link is cancelled when the router gives the attempt up, not after its timeout
            assert eventually(lambda: prefill_is_clean(f, "p") and f.worker_info("p")["pushing"] == 0, 5)
            assert not f.worker_info("dr")["healthy"]
        finally:
            remote.restore()
        f.wait_healthy(["dr"], timeout=30)
        assert eventually(lambda: decode_is_clean(f, "dr") and decode_is_clean(f, "d"), 20)
        assert client.ids == reference_ids(f.url, BIG)
        assert [complete(f.url).status_code for _ in range(4)] == [200] * 4  # round robin: two through dr


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("slow"), SLOW)


def test_router_killed_under_load_workers_free_everything_and_serve_a_new_one(slow_model):
    model = slow_model.rsplit("/", 1)[1]
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 3000, "ignore_eos": True}
    with Fleet("--model", slow_model) as f:
        f.pair()
        clients = started([StreamClient(f.url, body) for _ in range(3)])
        for c in clients:
            c.wait_tokens(2)
        f.router(name="router2")  # the next router up first: its start-up (~3-6 s here) is not in the window
        f.wait_healthy()
        f.signal("router", signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(2)  # (fresh heartbeats since)
        assert f.worker_info("d")["active"] == 3  # still generating for the dead router
        assert eventually(lambda: decode_is_clean(f, "d") and prefill_is_clean(f, "p"), 10)
        assert time.monotonic() - killed_at < 9  # silent for 5 s, then aborted
        assert all(c.error for c in clients)
        assert [complete(f.url, {"model": model, "prompt": "hi", "max_tokens": 4}).status_code
                for _ in range(3)] == [200] * 3


class Straggler(threading.Thread):
    """Runs a process at a tenth of its speed: stopped 90 ms of every 100."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done = pid, threading.Event()

    def run(self):
        while not self.done.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            time.sleep(0.09)
            os.kill(self.pid, signal.SIGCONT)
            time.sleep(0.01)

    def stop(self):
        self.done.set()
        self.join()
        os.kill(self.pid, signal.SIGCONT)


def test_straggling_decode_completes_its_requests_and_leaks_nothing():
    body = {"model": "tiny-llama", "prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0}
    with two_decodes() as f:
        want = reference_ids(f.url, body)
        slow = Straggler(f.procs["d1"].pid)
        slow.start()
        try:
            clients = started([StreamClient(f.url, body) for _ in range(4)])
            for c in clients:
                c.join(120)
            assert all(c.finished and not c.error and c.ids == want for c in clients), [c.error for c in clients]
            assert f.worker_info("d1")["healthy"]  # pongs come within 90 ms: slow is not dead
        finally:
            slow.stop()
        assert eventually(lambda: all(decode_is_clean(f, d) for d in ("d1", "d2")) and prefill_is_clean(f, "p"), 10)
        assert httpx.get(f.url + "/health").json()["admission"] == {"queued": 0, "in_flight": 0, "reserved": 0}
        assert [complete(f.url).status_code for _ in range(4)] == [200] * 4


def test_a_hung_decode_is_out_of_the_picks_within_a_second_and_back_when_it_answers():
    with two_decodes() as f:
        f.signal("d1", signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            assert eventually(lambda: not f.worker_info("d1")["healthy"], 3, 0.02)
            assert time.monotonic() - stopped_at < 1.0 + 0.3  # 1 s without a pong, plus a ping interval
            assert [complete(f.url).status_code for _ in range(6)] == [200] * 6  # all through d2, none waits on d1
        finally:
            f.signal("d1", signal.SIGCONT)
        assert eventually(lambda: f.worker_info("d1")["healthy"], 2)
        done = f.worker_info("d1")["completed"]
        assert [complete(f.url).status_code for _ in range(4)] == [200] * 4
        assert eventually(lambda: f.worker_info("d1")["completed"] == done + 2, 2)  # counters come with pongs
