"""The router's token path: tokens that arrive faster than the router sends them are joined into fewer SSE events,
and nothing is lost or reordered (real router process, the fake worker of ``bench.fake_worker`` making tokens as
fast as it can, the openai SDK)."""
import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from bench.router import start_fake_cluster
from router.inbox import coalesce


def test_coalesce_joins_waiting_tokens_and_stops_at_anything_else():
    q = asyncio.Queue()
    for msg in ({"op": "tokens", "ids": [2], "text": "b", "logprobs": [{"lp": -2}]},
                {"op": "tokens", "ids": [3, 4], "text": "cd", "logprobs": [{"lp": -3}, {"lp": -4}]},
                {"op": "done", "ids": [5], "text": "e"}, {"op": "tokens", "ids": [6], "text": "f"}):
        q.put_nowait(msg)
    first = {"op": "tokens", "rid": "r", "ids": [1], "text": "a", "logprobs": [{"lp": -1}]}
    got = coalesce(first, q)
    assert got == {"op": "tokens", "rid": "r", "ids": [1, 2, 3, 4], "text": "abcd",
                   "logprobs": [{"lp": -1}, {"lp": -2}, {"lp": -3}, {"lp": -4}]}
    lone = {"op": "tokens", "ids": [9], "text": "z"}
    assert coalesce(lone, q) is lone  # a non-token message next: nothing joined
    assert q.get_nowait()["op"] == "done" and q.qsize() == 1


@pytest.fixture
def fake_cluster():
    worker, router, rport = start_fake_cluster(0.0)
    procs = [worker, router]
    try:
        yield f"http://127.0.0.1:{rport}/v1"
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def test_tokens_faster_than_the_router_come_in_fewer_events(fake_cluster):
    from openai import OpenAI

    client = OpenAI(base_url=fake_cluster, api_key="unused")
    n = 5000  # over zmq's default high-water mark of 1,000 queued messages, which a ROUTER drops past
    stream = client.completions.create(model="fake", prompt="hi", max_tokens=n, stream=True,
                                       stream_options={"include_usage": True})
    text, events, usage = "", 0, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            events += 1
        if chunk.usage:
            usage = chunk.usage
    assert text == " tok" * n and usage.completion_tokens == n, (len(text) // 4, events, usage)
    assert events < 0.9 * n


def test_a_wait_past_its_time_ends_in_a_504():
    from router.waits import StreamError, Waits

    async def main():
        waits = Waits(stall_timeout_s=30.0)
        inbox = asyncio.Queue()
        waiter = asyncio.ensure_future(waits.next(inbox, 0.05, "the next token"))
        await asyncio.sleep(0.01)
        waits.expire()  # not yet
        assert not waiter.done() and len(waits.pending) == 1
        await asyncio.sleep(0.06)
        waits.expire()
        with pytest.raises(StreamError) as e:
            await waiter
        assert e.value.status == 504 and "the next token" in e.value.message and not waits.pending
        inbox.put_nowait({"op": "tokens", "ids": [1], "text": "a"})
        assert (await waits.next(inbox, 1.0, "x"))["text"] == "a"  # a message already there: no wait at all
    asyncio.run(main())
