"""Moving KV blocks between the GPU pool and a tier's slots (``kvcache.tiers``), in batches.

The pool is ``[2 x layers, blocks, ...]``: one block is strided over the layer planes, while a slot holds a block of
every layer contiguous. So blocks go through a staging buffer on the pool's device, ``STAGING_BYTES`` at a time:

- ``to_slots(todo)``: each ``(slot, block)``, gathered by one indexed copy into the staging buffer, then copied out
  (a run of consecutive slots as one copy). On a GPU this runs on the copier's own stream, after everything the
  current stream has queued (the blocks' KV is written; earlier loads out of these slots have read them), and
  returns the event that marks its end (None on the CPU, where the copies have ended by then).
- ``to_pool(pairs)``: each ``(slot, block)``, copied into the staging buffer (runs as one copy), then scattered into
  its block by one indexed copy, queued on the current stream.

Indexed copies move 8-byte words where a row allows (byte by byte they ran at half the pinned rate); block ids go to
the device once, from pinned memory. (A copy a block, each a temporary, a copy and a kernel, reached 61% of the
pinned rate on loads and held the engine's thread for a tenth of a prefill step on writes.)"""
from __future__ import annotations

import contextlib

import torch

STAGING_BYTES = 64 << 20  # each staging buffer on the pool's device


class Copier:
    def __init__(self, pool: torch.Tensor, slots: torch.Tensor):
        self.pool, self.slots = pool, slots
        self.cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self.buffers: dict[str, torch.Tensor] = {}

    def to_slots(self, todo: list[tuple[int, int]]):
        if not todo:
            return None
        with self._own_stream() as event:
            staging, pool = self._staging("write"), words(self.pool)
            blocks = indices([b for _, b in todo], self.pool.device)
            for start in range(0, len(todo), len(staging)):
                chunk = todo[start:start + len(staging)]
                staging[:len(chunk)].copy_(pool.index_select(1, blocks[start:start + len(chunk)]).transpose(0, 1))
                for i, j in runs([slot for slot, _ in chunk]):
                    first = chunk[i][0]
                    words(self.slots[first:first + j - i]).copy_(staging[i:j], non_blocking=self.cuda)
        return event

    def to_pool(self, pairs: list[tuple[int, int]]) -> None:
        staging, pool = self._staging("load"), words(self.pool)
        blocks = indices([b for _, b in pairs], self.pool.device)
        asynchronous = self.cuda and self.slots.is_pinned()
        for start in range(0, len(pairs), len(staging)):
            chunk = pairs[start:start + len(staging)]
            for i, j in runs([slot for slot, _ in chunk]):
                first = chunk[i][0]
                staging[i:j].copy_(words(self.slots[first:first + j - i]), non_blocking=asynchronous)
            pool.index_copy_(1, blocks[start:start + len(chunk)], staging[:len(chunk)].transpose(0, 1))

    @contextlib.contextmanager
    def _own_stream(self):
        if not self.cuda:
            yield None
            return
        ready = torch.cuda.Event()
        ready.record()
        self.stream.wait_event(ready)
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            yield event
            event.record(self.stream)

    def _staging(self, use: str) -> torch.Tensor:
        """The buffer for ``use`` ("load", on the engine's stream; "write", on the copier's), in slots of words."""
        if use not in self.buffers:
            slot = words(self.slots[0])
            count = max(1, min(len(self.slots), STAGING_BYTES // (self.slots[0].numel() * self.slots.element_size())))
            self.buffers[use] = torch.empty((count, *slot.shape), dtype=slot.dtype, device=self.pool.device)
        return self.buffers[use]


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as 8-byte words where its rows allow (indexed copies of bytes run a byte a thread)."""
    raw = t.view(torch.uint8)
    return raw.view(torch.int64) if raw.shape[-1] % 8 == 0 else raw


def indices(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device``, uploaded once without waiting (from pinned memory on a GPU)."""
    ids = torch.tensor(blocks, dtype=torch.long)
    return ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids


def runs(slots: list[int]):
    """``(i, j)`` for each run ``slots[i:j]`` of consecutive slots."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j
        i = j
