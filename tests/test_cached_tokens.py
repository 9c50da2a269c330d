"""``usage.prompt_tokens_details.cached_tokens`` as OpenAI clients read it, through the official SDK: a prompt sent
twice is computed in full the first time (0 cached) and from the prefix cache the second, whose count is what the
worker that computed it says it took from its cache (the growth of its ``prefix_cached_tokens``), and the
``pdserve`` block's ``cached_tokens_by_tier`` adds up to it. Colocated and disaggregated (1 prefill + 1 decode over
tcp), completions and chat, whole and streamed with ``include_usage``."""
import re
import time

import httpx
import openai
import pytest

from deploy.local import Cluster

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 4  # ~300 byte tokens
MODES = {"colocated": ("--colocated",), "disagg": ()}


@pytest.fixture(scope="module", params=list(MODES))
def url(request):
    cluster = Cluster(*MODES[request.param]).wait_ready()
    try:
        yield cluster.url
    finally:
        cluster.stop()


def counted(url) -> int:
    """The prompt tokens every worker took from its prefix cache, as its last heartbeat told the router."""
    workers = httpx.get(url + "/health", timeout=10).json()["workers"]
    return sum(w.get("prefix_cached_tokens", 0) for group in workers.values() for w in group)


def grown(url, since: int, timeout: float = 10.0) -> int:
    """How much ``counted`` grew from ``since`` once the workers' heartbeats show it growing."""
    end = time.monotonic() + timeout
    while (now := counted(url)) == since and time.monotonic() < end:
        time.sleep(0.1)
    return now - since


def ask(url, kind: str, stream: bool, prompt: str):
    """``(usage, pdserve block)`` of one request."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    args = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0}
    if stream:
        args.update(stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        r = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **args)
    else:
        r = c.completions.create(prompt=prompt, **args)
    last = list(r)[-1] if stream else r
    assert last.usage is not None
    return last.usage, last.model_extra["pdserve"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_repeated_prompt_counts_its_cached_tokens(url, kind, stream):
    prompt = f"{kind}-{stream}: {TEXT}"  # in no cache yet: its first block (16 tokens) is this test's own
    usage, block = ask(url, kind, stream, prompt)
    assert usage.prompt_tokens > 300 and usage.prompt_tokens_details.cached_tokens == 0
    assert sum(block["cached_tokens_by_tier"].values()) == 0
    before = counted(url)
    usage, block = ask(url, kind, stream, prompt)
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < usage.prompt_tokens
    assert sum(block["cached_tokens_by_tier"].values()) == cached
    assert grown(url, before) == cached


def test_tokens_from_the_host_tier_are_counted_and_named_by_tier():
    """A prompt the GPU pool evicted comes back from the host tier: its cached tokens count in ``usage`` and the
    ``pdserve`` block says they came from ``host``."""
    block = 16 * 2 * 4 * 2 * 16 * 4  # the tiny model's block: 16 tokens x K and V x 4 layers x 2 KV heads x 16 x fp32
    cluster = Cluster("--colocated", "--no-warmup", "--kv-budget", str(40 * block), "--kv-host-bytes",
                      str(400 * block)).wait_ready()
    try:
        prompt = "host tier: " + TEXT
        ask(cluster.url, "completions", False, prompt)
        for i in range(6):  # 1,800 other tokens through a pool of 640: the prompt's blocks leave it
            ask(cluster.url, "completions", False, f"{i} pushing it out. " + TEXT[::-1])
        usage, pdserve = ask(cluster.url, "completions", False, prompt)
        assert usage.prompt_tokens_details.cached_tokens > 0
        assert pdserve["cached_tokens_by_tier"].get("host") == usage.prompt_tokens_details.cached_tokens
        end = time.monotonic() + 10  # the worker's counters reach the router's /metrics with its next pong
        while not re.search(r"pdserve_worker_prefix_tokens_from_host\{[^}]*\} [1-9]",
                            metrics := httpx.get(cluster.url + "/metrics", timeout=10).text):
            assert time.monotonic() < end, metrics[-3000:]
            time.sleep(0.2)
        assert re.search(r"pdserve_worker_kv_host_loaded\{[^}]*\} [1-9]", metrics)
        assert pdserve["kv_tier_fetch"] > 0 and pdserve["kv_tier_load"] > 0  # its prefix's movements, ms
        assert re.search(r'pdserve_kv_tier_phase_seconds_count\{phase="load"\} [1-9]', metrics)
    finally:
        cluster.stop()
