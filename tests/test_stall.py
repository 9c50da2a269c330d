"""The stall watchdog (``router.waits``): a request that hears nothing from its worker for ``--stall-timeout``
fails with an error that says where it stood and on which worker, is counted in
``pdserve_requests_stalled_total{role,state}``, runs again elsewhere when nothing reached its client, and leaves no
KV behind. The stalls are made on purpose with the workers' test hook (``PDSERVE_TEST_MUTE``: a request's messages
dropped, the worker otherwise alive); ``pdserve up`` and the ``openai`` SDK as a user runs them."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from deploy.local import Cluster
from router.retry import RequestRun
from router.waits import DECODING, Stalled, Waits
from tests.test_retry import all_back
from tests.test_failures import eventually

STALL_S = 2.0


class Worker:
    role, address = "decode", "tcp://127.0.0.1:1"


def test_a_wait_with_no_word_past_the_stall_timeout_is_a_stall_that_says_where():
    async def main():
        waits = Waits(stall_timeout_s=0.05)
        run = RequestRun("r", {}, 0.0)
        waits.track("r", run)
        run.where, run.state = Worker(), DECODING
        inbox = asyncio.Queue()
        waiter = asyncio.ensure_future(waits.next(inbox, 60.0, "the next token", run))
        await asyncio.sleep(0.08)
        assert [s["state"] for s in waits.stuck()] == [DECODING]  # in flight longer than the stall timeout
        waits.expire()
        with pytest.raises(Stalled) as e:
            await waiter
        assert e.value.status == 504 and e.value.reason == "decode_stalled"
        assert "decoding on decode worker tcp://127.0.0.1:1" in e.value.message
        assert run.may_retry(e.value, retries=1)  # before the first byte: another worker may serve it
        run.streamed = True
        assert not run.may_retry(e.value, retries=1)
        waits.untrack("r")
        assert waits.stuck() == []
    asyncio.run(main())


def test_no_stall_watch_when_turned_off_or_longer_than_the_wait():
    async def main():
        for stall in (0.0, 10.0):
            waits = Waits(stall_timeout_s=stall)
            run = RequestRun("r", {}, 0.0)
            waits.track("r", run)
            waiter = asyncio.ensure_future(waits.next(asyncio.Queue(), 0.05, "the first token", run))
            await asyncio.sleep(0.08)
            waits.expire()
            with pytest.raises(Exception) as e:
                await waiter
            assert not isinstance(e.value, Stalled) and e.value.status == 504
    asyncio.run(main())


def stalled_count(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_requests_stalled_total\{([^}]*)\} (\S+)', text)}


@pytest.mark.serial  # bounds of a second
def test_up_fails_stalled_requests_in_time_and_keeps_serving(monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_MUTE", "STALL-BEFORE@0,STALL-AFTER@3")
    cluster = Cluster("--colocated", "--stall-timeout", str(STALL_S), "--retries", "1").wait_ready()
    try:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
        # Mid-stream: three tokens reach the client, then nothing: the stream ends with an error event (tokens from
        # decode were streamed: no retry).
        stream = client.completions.create(model="tiny-llama", prompt="STALL-AFTER tell me", max_tokens=200,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        got, last = [], None
        with pytest.raises(openai.APIError) as e:
            for chunk in stream:  # (an event may carry several tokens: ones that reached the router together)
                got += (chunk.choices[0].model_extra or {}).get("token_ids") or []
                last = time.monotonic()
        waited = time.monotonic() - last
        assert len(got) == 3 and STALL_S - 0.3 <= waited <= STALL_S + 1.0, (got, waited)
        assert "stalled" in str(e.value) and "decoding on colocated worker tcp://" in str(e.value)
        # Before the first byte: the attempt is given up, run again (--retries 1), stalls again, then a 504.
        t0 = time.monotonic()
        r = httpx.post(cluster.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "STALL-BEFORE x",
                                                              "max_tokens": 4}, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 504 and "stalled" in r.text, r.text
        assert 2 * STALL_S - 0.3 <= took <= 2 * (STALL_S + 1.0), took
        # A request meanwhile and after: served as usual.
        ok = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
        assert ok.choices[0].finish_reason == "length", ok  # (once "stop" in CI, not reproduced: the reply shows why)
        counts = stalled_count(cluster.url)
        assert counts.get('role="colocated",state="decoding"') == 1, counts
        assert sum(v for k, v in counts.items() if "decoding" not in k) == 2, counts
        retries = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert 'pdserve_request_retries_total{reason="colocated_stalled"} 1.0' in retries
        assert eventually(lambda: all_back(cluster.url), 10)  # the stalled requests' KV is freed
    finally:
        cluster.stop()
