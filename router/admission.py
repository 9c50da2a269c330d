"""Admission control: requests reserve KV memory on a decode (or colocated)
worker before any work starts, against the budget the worker reports, in
whole blocks of its paged pool.

A reservation starts as an upper-bound estimate (prompt bytes + max tokens)
and shrinks to the exact count once prefill reports the prompt's tokens.
When no worker has room the request waits in a bounded FIFO queue; a full
queue answers 429 at once, a wait longer than ``timeout_s`` answers 503, both
with ``Retry-After``."""
from __future__ import annotations

import asyncio
import collections

from .errors import ApiError


def estimate_prompt_tokens(payload: dict) -> int:
    if payload.get("messages") is not None:
        return sum(len(m["content"].encode()) + 16 for m in payload["messages"]) + 16
    prompt = payload.get("prompt")
    return len(prompt) + 2 if isinstance(prompt, list) else len(str(prompt).encode()) + 2


class Admission:
    def __init__(self, max_queue: int = 256, timeout_s: float = 30.0, retry_after_s: int = 1, pick_wait_s: float = 5.0):
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.pick_wait_s = pick_wait_s  # how long a request waits for a worker of its role to be in the picks
        self.reserved: dict[str, tuple[object, int]] = {}
        self.by_worker: collections.Counter = collections.Counter()
        self._waiters: collections.deque = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @staticmethod
    def cost(worker, tokens: int) -> int:
        """Bytes of the whole blocks ``tokens`` occupy on ``worker``."""
        max_len = worker.info.get("max_len") or tokens
        block = int(worker.info.get("kv_block_size") or 1)
        tokens = -(-min(tokens, max_len) // block) * block
        return tokens * int(worker.info.get("kv_bytes_per_token") or 0)

    def fits(self, worker, tokens: int) -> bool:
        budget = int(worker.info.get("kv_budget_bytes") or 0)
        if not budget:
            return True
        return self.by_worker[worker] + min(self.cost(worker, tokens), budget) <= budget

    def _try(self, group, rid: str, tokens: int, prompt=None, avoid=()):
        room = [w for w in group.healthy(avoid) if self.fits(w, tokens)]
        if not room:
            return None
        worker = group.policy.pick(room, prompt)
        self._hold(rid, worker, tokens)
        return worker

    def _hold(self, rid, worker, tokens):
        budget = int(worker.info.get("kv_budget_bytes") or 0)
        cost = min(self.cost(worker, tokens), budget) if budget else 0
        self.reserved[rid] = (worker, cost)
        self.by_worker[worker] += cost

    async def acquire(self, group, rid: str, tokens: int, prompt=None, avoid=()):
        """The worker that will hold this request's KV (not one in ``avoid`` while another has room); raises
        ApiError (429/503) when there is no room."""
        if not group.healthy() and not await group.wait_healthy(wait_s=self.pick_wait_s):
            raise ApiError(503, f"no healthy {group.role} worker", headers={"Retry-After": str(self.retry_after_s)})
        if not self._waiters:
            worker = self._try(group, rid, tokens, prompt, avoid)
            if worker is not None:
                return worker
        if len(self._waiters) >= self.max_queue:
            raise ApiError(429, f"server busy: {self.max_queue} requests already waiting for KV memory",
                           headers={"Retry-After": str(self.retry_after_s)})
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, group, rid, tokens, prompt, avoid)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except asyncio.TimeoutError:
            self._give_up(waiter, rid)
            raise ApiError(503, f"no KV memory free on any {group.role} worker after {self.timeout_s:.0f}s",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except asyncio.CancelledError:
            self._give_up(waiter, rid)
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _give_up(self, waiter, rid):
        if waiter.done() and not waiter.cancelled():
            self.release(rid)
        else:
            waiter.cancel()

    def adjust(self, rid: str, tokens: int) -> None:
        held = self.reserved.get(rid)
        if held is None:
            return
        worker, old = held
        self.by_worker[worker] -= old
        self._hold(rid, worker, tokens)
        self.wake()

    def move(self, rid: str, worker) -> None:
        """``rid``'s reservation onto ``worker``, where its request now decodes (``router.migration``)."""
        held = self.reserved.get(rid)
        if held is not None:
            self.by_worker[held[0]] -= held[1]
            self.reserved[rid] = (worker, held[1])
            self.by_worker[worker] += held[1]
            self.wake()

    def release(self, rid: str) -> None:
        held = self.reserved.pop(rid, None)
        if held is not None:
            worker, cost = held
            self.by_worker[worker] -= cost
        self.wake()

    def wake(self) -> None:
        while self._waiters:
            waiter, group, rid, tokens, prompt, avoid = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            worker = self._try(group, rid, tokens, prompt, avoid)
            if worker is None:
                return
            self._waiters.popleft()
            waiter.set_result(worker)
