"""Warm-up of prefill -> decode pairs: one short request through each pair
before the cluster says it is ready, so the first wave of real requests does
not pay a pair's one-time costs.

The nccl transport forms a process group per sender and receiver at their
first transfer (a TCP store, then NCCL's communicator: seconds, with every
other transfer of that sender queued behind it), and each end's GPU buffers
grow to their first KV sizes. ``PairWarmer`` runs in the router's lifespan:
every ``WARM_TICK_S`` it looks for (prefill, decode) pairs of healthy
workers it has not warmed (a mixed worker is never paired with itself) and
sends one request of ``WARM_PROMPT_TOKENS`` token ids and ``max_tokens=2``
through each, pinned to the pair, one at a time: the prompt prefilled on the
prefill worker, its KV moved, two tokens decoded. A pair whose warm-up fails
is logged and not tried again (real requests then form it as before); a
worker restarted at the same address (a new pid) makes new pairs. The
requests count in no router metric and take no ``--disagg auto`` decision.

``warm_pairs``: ``auto`` warms pairs whose decode worker uses the nccl
transport (the others' first transfer is a socket connection), ``always``
every pair, ``never`` none. Until the pairs seen at start-up are warm,
``/health`` answers 503 with ``"warming"``, so ``pdserve up`` and clients
that wait for ready wait for them too; pairs that appear later (a restarted
worker) are warmed in the background while the cluster serves."""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

MODES = ("auto", "always", "never")
WARM_TICK_S = 0.5
WARM_WAIT_S = 30.0  # after ready, how long /health waits for workers that have not answered yet
WARM_TIMEOUT_S = 120.0  # one pair's warm-up at most (a pair that hangs is left to real requests)
WARM_PROMPT_TOKENS = 40  # token ids 20..58 after a first id per pair (distinct prompts: no prefix-cache hit)


def warm_payload(index: int) -> dict:
    params = {"max_tokens": 2, "min_tokens": 0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 0, "stop": [],
              "stop_token_ids": [], "ignore_eos": True, "logprobs": None, "guide": None, "echo": False,
              "prompt_logprobs": None}
    return {"prompt": [10 + index % 10] + list(range(20, 20 + WARM_PROMPT_TOKENS - 1)), "params": params}


def pair_key(prefill, decode) -> tuple:
    """A pair of worker processes: a worker restarted at the same address (another pid) makes a new pair."""
    return prefill.address, prefill.info.get("pid"), decode.address, decode.info.get("pid")


class PairWarmer:
    def __init__(self, service, groups, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"warm_pairs {mode!r} not in {MODES}")
        self.service, self.groups, self.mode = service, groups, mode
        self.done: dict[tuple, str] = {}  # pair_key -> "ok" or why it failed
        self.started_up = mode == "never"  # the pairs seen at start-up are warm
        self._ready_at = 0.0

    def wanted(self, decode) -> bool:
        return self.mode == "always" or (self.mode == "auto" and decode.info.get("transport") == "nccl")

    def pending(self) -> list:
        """Pairs of healthy workers not warmed yet."""
        prefill, decode = self.groups.get("prefill"), self.groups.get("decode")
        if self.mode == "never" or prefill is None or decode is None:
            return []
        return [(p, d) for d in decode.clients if d.healthy and self.wanted(d)
                for p in prefill.clients if p.healthy and p.address != d.address
                and pair_key(p, d) not in self.done]

    def status(self) -> dict:
        return {"warm": sum(v == "ok" for v in self.done.values()), "failed": sum(v != "ok" for v in self.done.values()),
                "pending": len(self.pending()), "ready": self.started_up}

    async def run(self) -> None:
        while True:
            await self.warm_pending()
            await asyncio.sleep(WARM_TICK_S)

    async def warm_pending(self) -> None:
        for prefill, decode in self.pending():
            self.done[pair_key(prefill, decode)] = await self.warm(prefill, decode)
        if not self.started_up:
            self.started_up = self._settled()

    def _settled(self) -> bool:
        """Whether the start-up gate lifts: requests can be served and no pair worth warming is left (at once where
        no decode worker's transport wants it; else once every worker answered, or ``WARM_WAIT_S`` after ready)."""
        if not self.service.ready():
            return False
        self._ready_at = self._ready_at or time.monotonic()
        prefill, decode = self.groups.get("prefill"), self.groups.get("decode")
        if prefill is None or decode is None or not any(self.wanted(d) for d in decode.clients if d.healthy):
            return True
        if self.pending():
            return False
        answered = all(c.last_pong > 0 for g in self.groups.values() for c in g.clients)
        return answered or time.monotonic() - self._ready_at > WARM_WAIT_S

    async def warm(self, prefill, decode) -> str:
        t0 = time.perf_counter()
        try:
            where = await asyncio.wait_for(self.service.warm_pair(prefill, decode, warm_payload(len(self.done))),
                                           WARM_TIMEOUT_S)
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - a failed warm-up leaves the pair to real requests
            log.warning("warm-up of the pair %s -> %s failed: %s", prefill.address, decode.address, e)
            return f"failed: {e}"
        if where != (prefill.address, decode.address):
            log.warning("warm-up of the pair %s -> %s ran on %s -> %s", prefill.address, decode.address, *where)
        log.info("pair %s -> %s warm in %.0f ms", prefill.address, decode.address, (time.perf_counter() - t0) * 1e3)
        return "ok"
