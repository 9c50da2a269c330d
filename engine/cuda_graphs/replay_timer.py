"""How long the device spends in each decode graph replay, without waiting for it.

A serving decode step can take longer than the same step in ``bench engine``
for two different reasons: the device runs the step slower (other kernels
beside it, KV landing, a padded batch), or the device waits on the host
(scheduling, building the step's tables, the GIL shared with the control
plane and the transports). The step's wall time cannot tell them apart; a
pair of CUDA events around the replay can: ``elapsed`` is device time from
the replay's first kernel to its last (the start event fires when the
stream reaches it, after whatever ran before). The events are read only
once they have completed (``query``), at a later step, so timing adds no
synchronization; a ring of pairs is reused, and a replay whose pair is
still pending is simply not timed.

``StepLog`` sums the times (``decode_graph_ms``, ``decode_graph_steps``);
``bench goodput`` and ``/health`` report the mean beside the decode step's
wall time."""
from __future__ import annotations

from collections import deque

import torch

RING = 8  # event pairs; with a step in flight at most two are pending


class ReplayTimer:
    def __init__(self, make_event=None, ring: int = RING):
        """``make_event()``: a timing event (CUDA by default; tests pass their own)."""
        make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.free = deque((make_event(), make_event()) for _ in range(ring))
        self.pending: deque = deque()
        self.skipped = 0

    def start(self):
        """Record the start of a replay on the current stream: a handle for ``stop``, or None (all pairs pending)."""
        if not self.free:
            self.skipped += 1
            return None
        pair = self.free.popleft()
        pair[0].record()
        return pair

    def stop(self, pair) -> None:
        if pair is not None:
            pair[1].record()
            self.pending.append(pair)

    def done(self) -> list[float]:
        """Milliseconds of the replays whose events have completed since the last call, oldest first."""
        out = []
        while self.pending and self.pending[0][1].query():
            pair = self.pending.popleft()
            out.append(pair[0].elapsed_time(pair[1]))
            self.free.append(pair)
        return out
