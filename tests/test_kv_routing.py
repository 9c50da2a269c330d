"""Prefix caching through real clusters (``pdserve up``): the decode worker's cached blocks are not sent again,
outputs stay those of the reference, and ``kv_aware`` routing keeps conversations on the workers holding them."""
import time

import httpx
import pytest

from deploy.local import Cluster

SYSTEM = "You are a careful assistant. " * 34  # 986 bytes: ~1,000 tokens with the byte tokenizer


def complete(url, prompt, max_tokens=4):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def workers(url):
    return httpx.get(url + "/health", timeout=10).json()["workers"]


def settle(url, role, key, want, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = [w.get(key, 0) for w in workers(url)[role]]
        if want(got):
            return got
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def reference():
    cluster = Cluster("--colocated", "--no-prefix-caching").wait_ready()
    try:
        yield lambda prompt: complete(cluster.url, prompt)["choices"][0]["token_ids"]
    finally:
        cluster.stop()


@pytest.mark.parametrize("tp", [(), ("--prefill-tp", "2", "--decode-tp", "1"), ("--prefill-tp", "1", "--decode-tp", "2")],
                         ids=["tp1", "tp2to1", "tp1to2"])
def test_a_repeated_prefix_is_computed_once_and_sent_once(reference, tp):
    """Across tensor-parallel groups too: the held blocks are the same ids on every rank of the decode group."""
    cluster = Cluster("--policy", "kv_aware", *tp).wait_ready()
    try:
        first = complete(cluster.url, SYSTEM + "Question one?")
        settle(cluster.url, "decode", "prefix_cached_blocks", lambda got: got[0] > 0)
        time.sleep(1.5)  # the router's index hears of the decode worker's blocks
        second = complete(cluster.url, SYSTEM + "And question two?")
        for got, prompt in ((first, "Question one?"), (second, "And question two?")):
            assert got["choices"][0]["token_ids"] == reference(SYSTEM + prompt)
        full, rest = first["pdserve"]["kv_bytes"], second["pdserve"]["kv_bytes"]
        assert 0 < rest < full / 10, (full, rest)
        want = len(SYSTEM) // 16 * 16 - 16  # the workers' counters reach the router with their next heartbeat
        assert settle(cluster.url, "prefill", "prefix_cached_tokens", lambda got: got[0] >= want)[0] >= want
        assert settle(cluster.url, "prefill", "kv_skipped_bytes", lambda got: got[0] > 0)[0] > 0
    finally:
        cluster.stop()


@pytest.mark.parametrize("policy,floor", [("kv_aware", 0.9), ("round_robin", 0.0)])
def test_kv_aware_keeps_each_conversation_on_the_workers_holding_it(reference, policy, floor):
    """2 prefill + 2 decode, 4 conversation threads of 4 turns each, interleaved (in an order that changes every
    turn, so that taking turns does not by chance send a thread back to the same worker)."""
    cluster = Cluster("--prefill", "2", "--decode", "2", "--policy", policy, "--kv-weight", "0.1").wait_ready()
    try:
        threads = [f"Thread {t}: " + f"topic {t} " * 60 for t in range(4)]
        for turn in range(4):
            for t in ([0, 1, 2, 3] if turn % 2 == 0 else [1, 0, 3, 2]):
                threads[t] += f" turn {turn} question?"
                got = complete(cluster.url, threads[t])
                if turn == 0 and t == 0:
                    assert got["choices"][0]["token_ids"] == reference(threads[t])
                threads[t] += " answer." * 3
            time.sleep(1.2)  # cache events reach the router between turns
        time.sleep(1.5)  # and the counters, with the workers' heartbeats
        info = workers(cluster.url)
        prompt = sum(w["prefix_prompt_tokens"] for w in info["prefill"])
        cached = sum(w["prefix_cached_tokens"] for w in info["prefill"])
        first_turn = sum(len(("Thread 0: " + "topic 0 " * 60 + " turn 0 question?").encode()) for _ in range(4))
        rate = cached / (prompt - first_turn)
        if policy == "kv_aware":
            assert rate >= floor, rate
        else:
            assert rate < 0.75, rate
    finally:
        cluster.stop()
