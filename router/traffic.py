"""The traffic of the last ``WINDOW_S`` seconds, as ``--roles auto --roles-profile`` reads it (``router.role_plan``):
when requests arrived, and, of those that ended, their prompt tokens (the uncached ones where the router counted
them: ``uncached_tokens`` of the response's timing) and their output tokens. ``watch`` wraps a request's events
(``Service.generate``); a pair's warm-up does not pass through it."""
from __future__ import annotations

import contextlib
import time
from collections import deque

from .events import Finished

WINDOW_S = 20.0  # a replay of the shifting workload (bench.lab.roles_window) switched splits 25-30 s after each
# phase change with 20 s and a decision every 5 s, 60-70 s after (the phase over) with 60 s and every 10 s


class Traffic:
    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.arrivals: deque[float] = deque()
        self.ended: deque[tuple[float, int, int]] = deque()  # (when, prompt tokens, output tokens)
        self.first: float | None = None  # the first arrival: the rate counts from it (a router idles before traffic)

    def arrived(self) -> None:
        now = self.clock()
        self.arrivals.append(now)
        self.first = now if self.first is None else self.first
        self._expire()

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        self.ended.append((self.clock(), max(1, int(prompt_tokens)), max(1, int(output_tokens))))
        self._expire()

    def rate(self) -> float:
        """Requests a second that arrived over the window (or since the first arrived, if that is shorter, and at
        least a second)."""
        self._expire()
        if self.first is None:
            return 0.0
        return len(self.arrivals) / min(self.window_s, max(1.0, self.clock() - self.first))

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens) of the requests that ended in the window, oldest first."""
        self._expire()
        return [(p, o) for _, p, o in self.ended]

    async def watch(self, events):
        """``events`` (a request's ``Delta``/``Finished``) passed on, the request counted as it arrives and ends."""
        self.arrived()
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, Finished):
                    uncached = ev.timing.get("uncached_tokens")
                    self.finished(ev.prompt_tokens if uncached is None else uncached, ev.completion_tokens)
                yield ev

    def _expire(self) -> None:
        start = self.clock() - self.window_s
        while self.arrivals and self.arrivals[0] < start:
            self.arrivals.popleft()
        while self.ended and self.ended[0][0] < start:
            self.ended.popleft()
