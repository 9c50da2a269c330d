"""The cluster-wide KV pool (``--kv-pool mooncake``: ``pdserve up`` starts Mooncake's master and this host's daemon)
on the CPU with the tiny model: a prefix one prefill worker computed is used by the other without being computed
again (the workers' counters), with the same greedy text as the cold run, after the worker that computed it was
killed (the blocks live in the daemon's segment, not in their writer); and the pool's servers start again on other
ports when a port they were given is taken."""
import os
import signal
import sys
import time

import httpx
import pytest

from deploy import kv_pool_servers
from deploy.local import Cluster

pytest.importorskip("mooncake.store", reason="Mooncake Store (pip install mooncake-transfer-engine-non-cuda; "
                    "libibverbs1)", exc_type=ImportError)

PROMPT = [(i * 37) % 200 + 40 for i in range(300)]  # 18 whole blocks of 16 tokens and 12 tokens more


def workers(url: str) -> dict:
    return {w["address"]: w for w in httpx.get(url + "/health", timeout=10).json()["workers"]["prefill"]}


def grown(url: str, before: dict, key: str, by: int) -> dict:
    """The workers once one's ``key`` has grown by ``by`` since ``before`` (counters reach /health with a pong)."""
    end = time.monotonic() + 60
    while True:
        now = workers(url)
        if any(w[key] - before[a][key] >= by for a, w in now.items()) or time.monotonic() > end:
            return now
        time.sleep(0.2)


def complete(url: str) -> dict:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_computed_on_one_prefill_worker_is_fetched_by_the_other_after_it_died():
    cluster = Cluster("--prefill", "2", "--kv-pool", "mooncake", "--kv-pool-bytes", "256M", "--policy",
                      "round_robin", "--no-warmup", ready_timeout=240).wait_ready()
    try:
        before = workers(cluster.url)
        cold = complete(cluster.url)
        middle = grown(cluster.url, before, "pool_published", 18)  # its blocks reach the store in the background
        (computed_on,) = [a for a, w in middle.items() if w["prefix_prompt_tokens"] > before[a]["prefix_prompt_tokens"]]
        assert middle[computed_on]["pool_published"] - before[computed_on]["pool_published"] == 18
        routed = grown(cluster.url, before, "router_keys_pooled", 18)  # the router knows they are in the pool
        assert routed[computed_on]["router_keys_pooled"] - before[computed_on]["router_keys_pooled"] == 18
        (other,) = [a for a in middle if a != computed_on]
        os.kill(middle[computed_on]["pid"], signal.SIGKILL)
        warm = complete(cluster.url)
        after = grown(cluster.url, middle, "prefix_prompt_tokens", 300)
        assert after[other]["prefix_prompt_tokens"] - middle[other]["prefix_prompt_tokens"] == 300  # the other one
        assert after[other]["prefix_cached_tokens"] - middle[other]["prefix_cached_tokens"] == 288
        assert after[other]["prefix_pool_cached_tokens"] - middle[other]["prefix_pool_cached_tokens"] == 288
        assert after[other]["pool_loaded"] - middle[other]["pool_loaded"] == 18
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["pdserve"]["cached_tokens_by_tier"]["pool"] == 288 and warm["pdserve"]["kv_tier_fetch"] > 0
    finally:
        cluster.stop()


def test_a_pool_server_that_exits_on_a_taken_port_starts_again_on_other_ports(tmp_path):
    tries = []

    def make(ports):  # the first start exits at once, as a server whose port was taken does
        tries.append(ports)
        code = "raise SystemExit(1)" if len(tries) == 1 else (
            f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {ports[0]})); s.listen(); time.sleep(60)")
        return [sys.executable, "-c", code], ports[:1]

    server, ports = kv_pool_servers.start(make, "127.0.0.1", str(tmp_path / "log"), "a test server")
    try:
        assert len(tries) == 2 and ports == tries[1] and server.proc.poll() is None
    finally:
        server.stop()


def test_a_pool_that_is_not_a_mooncake_daemon_is_refused_with_the_way_to_name_one():
    from kvcache.stores import open_store

    with pytest.raises(ValueError, match="pdserve up"):
        open_store("mooncake")
    with pytest.raises(ValueError, match="mooncake://HOST:PORT"):
        open_store("ray")
    with pytest.raises(RuntimeError, match="no Mooncake daemon"):
        open_store("mooncake://127.0.0.1:9")
