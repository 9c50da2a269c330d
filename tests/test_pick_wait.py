"""A request that finds no worker of a role in the picks (every one late on its pong, or suspect, for a moment)
waits a few seconds for one before it answers 503, instead of failing at once."""
import asyncio
import time

import pytest

from router.workers import WorkerClient, WorkerGroup

pytestmark = pytest.mark.serial  # waits of 0.2-1.5 s, timed


class First:
    @staticmethod
    def pick(ready, prompt=None):
        return ready[0]


def _group(n: int = 2) -> WorkerGroup:
    return WorkerGroup("prefill", [WorkerClient(f"tcp://127.0.0.1:{9000 + i}", "prefill", {}) for i in range(n)], First)


def test_a_worker_back_in_the_picks_within_the_wait_is_picked():
    group = _group()
    late, suspect = group.clients
    suspect.last_pong = time.monotonic()
    suspect.suspect_until = time.monotonic() + 0.3  # out of the picks for 0.3 s; the other never answered
    assert group.healthy() == []

    async def main():
        start = time.monotonic()
        ready = await group.wait_healthy(wait_s=3.0)
        return ready, time.monotonic() - start

    ready, waited = asyncio.run(main())
    assert ready == [suspect] and 0.2 <= waited < 1.5


def test_none_back_within_the_wait_gives_up_after_it():
    group = _group()

    async def main():
        start = time.monotonic()
        ready = await group.wait_healthy(wait_s=0.3)
        return ready, time.monotonic() - start

    ready, waited = asyncio.run(main())
    assert ready == [] and 0.3 <= waited < 1.0
