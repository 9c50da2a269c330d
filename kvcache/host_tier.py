"""A worker's host-memory tier: full KV blocks the GPU pool evicted, kept in (pinned) host memory, LRU.

The pool is ``[2 x layers, blocks, block_size, kv_heads, head_dim]`` (``engine.kv_pool.KVPool.stacked``); a slot
here holds one block of every layer, ``[2 x layers, block_size, kv_heads, head_dim]``, contiguous.

- ``offload(key, block)``: the pool's ``block``, about to be handed out again, holds the KV keyed ``key``: its
  copy is queued into a free slot (the least recently used key is dropped when none is free; ``on_drop(key)``
  says so) on the device's current stream, before anything that overwrites the block, and an event marks its end.
  A key held already is only marked as recently used. True: the key lives on here.
- ``match(keys)``: the slots of the longest run of ``keys`` held here whose copy has completed. A slot still being
  written is never read: the run stops there and ``stats.skipped_in_flight`` counts it.
- ``pin(slots)``, then ``load(pairs)``: the matched slots are kept from being dropped until their ``(slot, block)``
  copies back into the pool are queued (before the step that reads the blocks), which unpins them.
- ``settle()``: waits for every copy queued so far (a caller on another thread or stream needs them done).

On the CPU every copy is done when queued. Eviction is LRU over keys (a load counts as a use)."""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch


@dataclass
class TierStats:
    offloaded: int = 0  # blocks copied in
    loaded: int = 0  # blocks copied back to the pool
    dropped: int = 0  # keys evicted from this tier
    skipped_in_flight: int = 0  # matches that stopped at a block still being written

    def to_dict(self) -> dict:
        return asdict(self)


def host_capacity_blocks(nbytes: int, block_bytes: int, flag: str = "--kv-host-bytes") -> int:
    """Blocks of ``block_bytes`` that ``nbytes`` of host memory holds; a clear error for sizes no machine gives."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{flag} must be a positive size, e.g. 80G (got {nbytes!r})")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > physical:
        raise ValueError(f"{flag} {nbytes / 2**30:.1f} GiB is more than this machine's {physical / 2**30:.1f} GiB "
                         "of memory")
    if nbytes < block_bytes:
        raise ValueError(f"{flag} {nbytes} bytes holds no KV block ({block_bytes} bytes each)")
    return nbytes // block_bytes


class HostTier:
    policy = "LRU"

    def __init__(self, pool: torch.Tensor, capacity_blocks: int, on_drop=None):
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        shape = (capacity_blocks, pool.shape[0], *pool.shape[2:])
        self.slots = torch.empty(shape, dtype=pool.dtype, pin_memory=self.cuda)
        self.capacity = capacity_blocks
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self.key_of: dict[int, int] = {}
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.writing: dict[int, object] = {}  # slot -> the event that ends its copy (CUDA)
        self.pinned: dict[int, int] = {}  # slot -> loads queued for it in this step
        self.on_drop = on_drop
        self.stats = TierStats()

    @property
    def block_bytes(self) -> int:
        return self.slots[0].numel() * self.slots.element_size()

    def __len__(self) -> int:
        return len(self.slot_of)

    def offload(self, key: int, block: int) -> bool:
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return True
        slot = self.free.pop() if self.free else self._drop_oldest()
        if slot is None:  # every slot is about to be loaded from: this key is not kept
            return False
        self.slots[slot].copy_(self.pool[:, block], non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.writing[slot] = event
        self.slot_of[key], self.key_of[slot] = slot, key
        self.stats.offloaded += 1
        return True

    def _drop_oldest(self) -> int | None:
        key = next((k for k, s in self.slot_of.items() if s not in self.pinned), None)
        if key is None:
            return None
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        self.stats.dropped += 1
        if self.on_drop is not None:
            self.on_drop(key)
        return slot  # a copy into it still in flight is ordered before the next one on the same stream

    def match(self, keys: list[int]) -> list[int]:
        out = []
        for key in keys:
            slot = self.slot_of.get(key)
            if slot is None:
                break
            event = self.writing.get(slot)
            if event is not None:
                if not event.query():
                    self.stats.skipped_in_flight += 1
                    break
                del self.writing[slot]
            out.append(slot)
        return out

    def pin(self, slots: list[int]) -> None:
        for slot in slots:
            self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def load(self, pairs: list[tuple[int, int]]) -> None:
        for slot, block in pairs:
            self.pool[:, block].copy_(self.slots[slot], non_blocking=self.cuda)
            self.slot_of.move_to_end(self.key_of[slot])
            self.pinned[slot] -= 1
            if not self.pinned[slot]:
                del self.pinned[slot]
        self.stats.loaded += len(pairs)

    def settle(self) -> None:
        for event in self.writing.values():
            event.synchronize()
        self.writing.clear()

    def info(self) -> dict:
        return {"host_blocks": len(self.slot_of), "host_capacity_blocks": self.capacity, "host_policy": self.policy,
                **{f"host_{k}": v for k, v in self.stats.to_dict().items()}}


def attach(pool: torch.Tensor, blocks, nbytes: int, block_bytes: int) -> HostTier | None:
    """A host tier of ``nbytes`` under ``blocks`` (the pool's ``engine.blocks.BlockManager``); None for 0 bytes."""
    if not nbytes:
        return None
    tier = HostTier(pool, host_capacity_blocks(nbytes, block_bytes), on_drop=blocks.dropped_below)
    blocks.lower = tier
    return tier
