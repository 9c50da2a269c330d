"""The cluster-wide KV pool (``--kv-pool ray``) on the CPU with the tiny model: a prefix one prefill worker computed
is used by the other without being computed again (the workers' counters), with the same greedy text as the cold
run; the Ray object store is the store (the session's two-node Ray cluster on loopback)."""
import time

import httpx

from deploy.local import Cluster

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


def test_a_prefix_computed_on_one_prefill_worker_is_fetched_by_the_other(ray_cluster):
    cluster = Cluster("--prefill", "2", "--kv-pool", "ray", "--policy", "round_robin", "--no-warmup",
                      ready_timeout=240).wait_ready()
    try:
        before = workers(cluster.url)
        cold = complete(cluster.url)
        middle = grown(cluster.url, before, "pool_published", 18)  # its blocks reach the store in the background
        (computed_on,) = [a for a, w in middle.items() if w["prefix_prompt_tokens"] > before[a]["prefix_prompt_tokens"]]
        assert middle[computed_on]["pool_published"] - before[computed_on]["pool_published"] == 18
        warm = complete(cluster.url)
        after = grown(cluster.url, middle, "prefix_prompt_tokens", 300)
        (other,) = [a for a in after if a != computed_on]
        assert after[other]["prefix_prompt_tokens"] - middle[other]["prefix_prompt_tokens"] == 300  # the other one
        assert after[other]["prefix_cached_tokens"] - middle[other]["prefix_cached_tokens"] == 288
        assert after[other]["prefix_pool_cached_tokens"] - middle[other]["prefix_pool_cached_tokens"] == 288
        assert after[other]["pool_loaded"] - middle[other]["pool_loaded"] == 18
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["pdserve"]["cached_tokens_by_tier"]["pool"] == 288 and warm["pdserve"]["kv_tier_fetch"] > 0
    finally:
        cluster.stop()
