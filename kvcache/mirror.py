"""A host tier's copies repeated on the other ranks of a tensor-parallel group or the other stages of a pipeline.

Rank 0 (stage 0 of a pipeline) keeps the whole tier: its keys, their order, which slot holds what. Every other rank
holds its own slice of the KV (its heads, or its layers) in a host tier with the same number of slots, and makes
the same copies as rank 0, in the same order, as the plan (``engine.parallel.plan``) tells it, a message a batch:

- ``tier{do: "out", pairs}``: each ``[slot, block]``, the rank's pool block copied into its slot (on a GPU on the
  copier's stream, as rank 0's);
- ``tier{do: "wait", slots}``: the rank's stream waits for the copies into these slots (before it overwrites the
  blocks they came from);
- ``tier{do: "in", pairs}``: each ``[slot, block]``, the slot copied into the pool block, after its copy in ended;
- ``tier{do: "settle"}``: every copy into a slot waited for (another thread writes the pool next: KV received).

Rank 0 sends each one (``Echo``) as it queues its own copy, before the step or the KV work that depends on it, so
each rank meets them in rank 0's order. A slot rank 0 found written may still be in flight on another rank: that rank
waits for its own copy (``MirrorTier``), so no rank reads a slot before its bytes are there."""
from __future__ import annotations

import torch

from .copies import Copier


class Echo:
    """Rank 0's end: a tier's copies put on the plan for the other ranks (``send(op, **fields)``; msgpack sends the
    pairs' tuples as lists)."""

    def __init__(self, send):
        self.send = send

    def __call__(self, do: str, **fields) -> None:
        self.send("tier", do=do, **fields)


class MirrorTier:
    """Another rank's end: slots for its slice of each block, the copies rank 0 sends made on its own pool."""

    def __init__(self, pool: torch.Tensor, capacity: int):
        cuda = pool.device.type == "cuda"
        slots = torch.empty((capacity, pool.shape[0], *pool.shape[2:]), dtype=pool.dtype, pin_memory=cuda)
        self.copier, self.cuda, self.capacity = Copier(pool, slots), cuda, capacity
        self.writing: dict[int, object] = {}  # slot -> the event that ends its copy in (CUDA)

    def handle(self, msg: dict) -> None:
        do = msg["do"]
        if do == "out":
            pairs = [tuple(p) for p in msg["pairs"]]
            event = self.copier.to_slots(pairs)
            if event is not None:
                self.writing.update((slot, event) for slot, _ in pairs)
        elif do == "wait":
            self._wait(msg["slots"], pop=False)
        elif do == "in":
            pairs = [tuple(p) for p in msg["pairs"]]
            self._wait([slot for slot, _ in pairs], pop=True)
            self.copier.to_pool(pairs)
        elif do == "settle":
            for event in {id(e): e for e in self.writing.values()}.values():
                event.synchronize()
            self.writing.clear()
        else:
            raise ValueError(f"unknown tier copy {do!r} from rank 0")

    def _wait(self, slots: list[int], pop: bool) -> None:
        events = {}
        for slot in slots:
            event = self.writing.pop(slot, None) if pop else self.writing.get(slot)
            if event is not None:
                events[id(event)] = event
        for event in events.values():
            torch.cuda.current_stream().wait_event(event)
