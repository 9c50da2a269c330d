"""Matched tier blocks brought back into the GPU pool: ``pin`` keeps each matched ``(tier, slot)`` until ``load``
queues its copy into the pool (before the step that reads it), timed for the sequences it is for (``LoadTime``,
reported by ``phases`` as the response's ``kv_tier_fetch`` and ``kv_tier_load``)."""
from __future__ import annotations

import time

import torch

from .tiers import Tier


def pin(handles: list[tuple]) -> None:
    """Keep each matched ``(tier, slot)`` until it is loaded."""
    for tier, slot in handles:
        tier.pin_one(slot)


def load(pairs: list[tuple], seqs: list = ()) -> None:
    """Each ``((tier, slot), block)``: the tier's block copied into the pool's ``block``, queued on its stream; the
    sequences the blocks are for get the copies' time (``LoadTime``) as ``tier_load``."""
    took = LoadTime(pairs[0][0][0].pool.device if pairs else torch.device("cpu"))
    by_tier: dict[Tier, list[tuple[int, int]]] = {}
    for (tier, slot), block in pairs:
        by_tier.setdefault(tier, []).append((slot, block))
    for tier, items in by_tier.items():
        tier.load_many(items)
    took.stop()
    for seq in seqs:
        seq.tier_load = took


class LoadTime:
    """How long one step's tier loads took: wall time on the CPU, between two CUDA events on a GPU (read once the
    copies are done: ``ms`` is None until then)."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.wall = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.wall = (time.perf_counter() - self.start) * 1e3

    def ms(self) -> float | None:
        if self.events is None:
            return self.wall
        return self.events[0].elapsed_time(self.events[1]) if self.events[1].query() else None


def phases(seq) -> dict:
    """A sequence's tier movements for its ``first`` timing: ``kv_tier_fetch`` (finding and fetching its prefix in
    the tiers and the cluster pool, ms) and ``kv_tier_load`` (copying it into the GPU pool, ms), where it had any."""
    out = {}
    if getattr(seq, "tier_fetch_ms", None) is not None:
        out["kv_tier_fetch"] = seq.tier_fetch_ms
    load = getattr(seq, "tier_load", None)
    if load is not None and load.ms() is not None:
        out["kv_tier_load"] = load.ms()
    return out
