"""The tiers under a worker's GPU pool: full KV blocks the pool evicted, in (pinned) host memory and then on disk.

The pool is ``[2 x layers, blocks, block_size, kv_heads, head_dim]`` (``engine.kv_pool.KVPool.stacked``); a slot of
a tier holds one block of every layer, ``[2 x layers, block_size, kv_heads, head_dim]``, contiguous. A tier's
slots are pinned host memory (``HostTier``) or a file mapped into memory (``kvcache.disk``); each tier is LRU over keys
and may have a ``lower`` one, which gets what it drops. A key loaded back into the pool is held twice, so it goes to
the front of the order: the first dropped when room is needed (not passed down: the pool offers it again when it
evicts it). The pool and the tiers then hold as many distinct blocks as they have room for together. (Kept as the
most recent use instead, a copy held twice cost room, and a window a little larger than the tier replayed again
lost a third of its hits: each miss dropped the block a later request needed.)

- ``offload_many(pairs)``: each ``(key, block)``, a pool block about to be handed out again: copied into a free
  slot (the least recently used key is dropped, or passed down, when none is free), all in one batch
  (``kvcache.copies``: on a GPU on the tier's own stream, the engine's stream waiting for it before it overwrites
  the blocks). A key held already is only marked as recently used. Returns the keys that live on here (or below).
- ``write_ahead(pairs)``: idle pool blocks next in line to be evicted, copied in now, beside the step that
  follows, so that their eviction copies nothing. ``taken(key)``: the pool handed a cached block out again (its
  copy here is held twice: to the front).
- ``match(keys)``: handles ``(tier, slot)`` of the longest run of ``keys`` held here and then below. A slot still
  being written is never read: the run stops there (``skipped_in_flight``). A disk slot whose checksum (taken when
  it was written) no longer matches is dropped and stops the run (``corrupt``): that block is computed again.
- ``pin_one(slot)``, then ``load_many(pairs)`` (through ``kvcache.loads``, where a handle names its tier): matched
  slots are kept from being dropped until their copies back into the pool are queued (before the step that reads
  the blocks), which unpins them.
- ``settle()``: waits for every copy queued so far (a caller on another thread or stream needs them done).

``on_drop(key)`` is called when a key leaves the last tier (the block manager then reports it evicted), ``on_sink(key)``
when one is passed down and kept below (reported sunk: on disk); with several ranks, ``echo`` sends each copy to the
others (``kvcache.mirror``)."""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from .copies import Copier


@dataclass
class TierStats:
    offloaded: int = 0  # blocks copied in
    loaded: int = 0  # blocks copied back to the pool
    dropped: int = 0  # keys this tier let go (passed down, or gone)
    skipped_in_flight: int = 0  # matches that stopped at a block still being written
    corrupt: int = 0  # blocks whose checksum failed (recomputed)
    written_ahead: int = 0  # idle pool blocks copied in before their eviction (which then copied nothing)

    def to_dict(self) -> dict:
        return asdict(self)


def capacity_blocks(nbytes: int, block_bytes: int, flag: str, room: int) -> int:
    """Blocks of ``block_bytes`` in ``nbytes``; a clear error for sizes this machine cannot give (``room`` bytes)."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{flag} must be a positive size, e.g. 80G (got {nbytes!r})")
    if nbytes > room:
        raise ValueError(f"{flag} {nbytes / 2**30:.1f} GiB is more than this machine's {room / 2**30:.1f} GiB")
    if nbytes < block_bytes:
        raise ValueError(f"{flag} {nbytes} bytes holds no KV block ({block_bytes} bytes each)")
    return nbytes // block_bytes


def host_capacity_blocks(nbytes: int, block_bytes: int, flag: str = "--kv-host-bytes") -> int:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return capacity_blocks(nbytes, block_bytes, flag + " (of memory)", memory)


class Tier:
    policy = "LRU, blocks loaded back into the pool dropped first"
    name = "tier"

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor, on_drop=None, lower: "Tier | None" = None):
        self.pool, self.slots, self.lower, self.on_drop = pool, slots, lower, on_drop
        self.cuda = pool.device.type == "cuda"
        self.copier = Copier(pool, slots)
        self.capacity = slots.shape[0]
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self.key_of: dict[int, int] = {}
        self.free = list(range(self.capacity - 1, -1, -1))
        self.writing: dict[int, object] = {}  # slot -> the event that ends its copy (CUDA)
        self.pinned: dict[int, int] = {}  # slot -> loads queued for it in this step
        self.above: set[int] = set()  # keys loaded back into the pool (held there too) and not offered since
        self.batch: dict[int, int] = {}  # slot -> pool block: copies placed by this call, not made yet (``_flush``)
        self.echo = None  # rank 0 of a group or pipeline: each copy sent to the other ranks (``kvcache.mirror``)
        self.on_sink = None  # called with a key passed down to ``lower`` and kept there
        self.stats = TierStats()

    def offload(self, key: int, block: int) -> bool:
        return key in self.offload_many([(key, block)])

    def offload_many(self, pairs: list[tuple[int, int]]) -> set[int]:
        """Each ``(key, block)``: the pool's ``block`` is about to be overwritten. Its copy (made now, all of them
        in one batch, or ahead by ``write_ahead``) ends before anything queued after this call runs. Returns the
        keys that live on here (or below)."""
        kept = set()
        for key, block in pairs:
            if key in self.slot_of:
                self.slot_of.move_to_end(key)
                self.above.discard(key)
                kept.add(key)
            elif (slot := self._place(key)) is not None:
                self.batch[slot] = block
                kept.add(key)
            elif self.lower is not None and self.lower.put(key, self.pool[:, block]):
                kept.add(key)
                self._sink(key)
        self._flush()
        if self.echo is not None and kept:  # each rank waits for its own copies (done here is not done there)
            self.echo("wait", slots=[self.slot_of[k] for k in kept if k in self.slot_of])
        if self.cuda:
            waits = {id(e): e for e in (self.writing.get(self.slot_of.get(k)) for k in kept) if e is not None}
            for event in waits.values():
                torch.cuda.current_stream().wait_event(event)
        return kept

    def write_ahead(self, pairs: list[tuple[int, int]]) -> int:
        """Each ``(key, block)``: an idle block next in line to be evicted, copied out now (on a GPU beside the step
        that follows), so that its eviction copies nothing. Returns how many were copied."""
        count = 0
        for key, block in pairs:
            if key in self.slot_of:
                continue
            slot = self._place(key)
            if slot is None:
                break
            self.batch[slot] = block
            count += 1
        self._flush()
        self.stats.written_ahead += count
        return count

    def put(self, key: int, source: torch.Tensor) -> bool:
        """``source`` (one block of every layer, from a tier above) kept under ``key``."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            self.above.discard(key)
            return True
        slot = self._place(key)
        if slot is None:  # every slot is about to be loaded from: this key is not kept
            return self.lower is not None and self.lower.put(key, source)
        self._write(slot, source)
        self.stats.offloaded += 1
        return True

    def _place(self, key: int) -> int | None:
        """A slot for ``key`` (free, or the least recently used one's), None when every slot is pinned. The batch
        not copied yet (``batch``) is copied first when the slot to be dropped is one of its own (a batch larger than
        the tier wraps around: the dropped key's bytes must be in its slot)."""
        if not self.free and self.batch and self.slot_of.get(self._victim()) in self.batch:
            self._flush()
        slot = self.free.pop() if self.free else self._drop_oldest()
        if slot is not None:
            self.slot_of[key], self.key_of[slot] = slot, key
        return slot

    def _flush(self) -> None:
        """The batch's blocks into their slots, in one go (``kvcache.copies``); on a GPU each slot is being written
        until the batch's event."""
        todo, self.batch = list(self.batch.items()), {}
        event = self.copier.to_slots(todo)
        if self.echo is not None and todo:
            self.echo("out", pairs=todo)
        if event is not None:
            for slot, _ in todo:
                self.writing[slot] = event
        self.stats.offloaded += len(todo)

    def keys(self) -> list[int]:
        """The keys held here and below."""
        return list(self.slot_of) + (self.lower.keys() if self.lower is not None else [])

    def taken(self, key: int) -> None:
        """The pool hands out again an idle block it had kept (a prefix hit): a copy held here is held twice, and
        goes to the front of the order, as a loaded one does."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key, last=False)
            self.above.add(key)

    def _write(self, slot: int, source: torch.Tensor) -> None:
        self.slots[slot].copy_(source)

    def _victim(self) -> int | None:
        """The least recently used key whose slot is not pinned."""
        return next((k for k, s in self.slot_of.items() if s not in self.pinned), None)

    def _drop_oldest(self) -> int | None:
        key = self._victim()
        if key is None:
            return None
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        self.stats.dropped += 1
        if key in self.above:  # the pool holds it: it comes back when the pool evicts it
            self.above.discard(key)
            if self.on_drop is not None:
                self.on_drop(key)
            return slot
        if self.lower is not None:
            self._settle(slot)
            if self.lower.put(key, self.slots[slot]):
                self._sink(key)
                return slot
        if self.on_drop is not None:
            self.on_drop(key)
        return slot  # a copy into it still in flight is ordered before the next one on the same stream

    def _sink(self, key: int) -> None:
        if self.on_sink is not None:
            self.on_sink(key)

    def _forget(self, key: int) -> None:
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        self.above.discard(key)
        self.free.append(slot)
        if self.on_drop is not None:
            self.on_drop(key)

    def match(self, keys: list[int]) -> list[tuple["Tier", int]]:
        out = []
        for key in keys:
            slot = self.slot_of.get(key)
            if slot is None:
                break
            event = self.writing.get(slot)
            if event is not None:
                if not event.query():
                    self.stats.skipped_in_flight += 1
                    return out
                del self.writing[slot]
            if not self._intact(slot):
                self.stats.corrupt += 1
                self._forget(key)
                return out
            out.append((self, slot))
        if self.lower is not None and len(out) < len(keys):
            out += self.lower.match(keys[len(out):])
        return out

    def _intact(self, slot: int) -> bool:
        return True

    def pin_one(self, slot: int) -> None:
        self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def load_many(self, pairs: list[tuple[int, int]]) -> None:
        """Each ``(slot, block)``: the slot copied into the pool's ``block``, queued on the current stream, in one
        batch (``kvcache.copies``)."""
        self.copier.to_pool(pairs)
        if self.echo is not None:
            self.echo("in", pairs=pairs)
        for slot, _ in pairs:
            self._loaded(slot)

    def _loaded(self, slot: int) -> None:
        key = self.key_of[slot]
        self.slot_of.move_to_end(key, last=False)
        self.above.add(key)
        self.pinned[slot] -= 1
        if not self.pinned[slot]:
            del self.pinned[slot]
        self.stats.loaded += 1

    def _settle(self, slot: int) -> None:
        event = self.writing.pop(slot, None)
        if event is not None:
            event.synchronize()

    def settle(self) -> None:
        for slot in list(self.writing):
            self._settle(slot)
        if self.echo is not None:
            self.echo("settle")

    def info(self) -> dict:
        out = {f"{self.name}_blocks": len(self.slot_of), f"{self.name}_capacity_blocks": self.capacity,
               f"{self.name}_policy": self.policy, **{f"{self.name}_{k}": v for k, v in self.stats.to_dict().items()}}
        return {**out, **(self.lower.info() if self.lower is not None else {})}


class HostTier(Tier):
    """Slots in host memory, pinned when the pool is on a GPU (copies at the link's full rate, asynchronous)."""
    name = "host"

    def __init__(self, pool: torch.Tensor, capacity: int, on_drop=None, lower: Tier | None = None):
        shape = (capacity, pool.shape[0], *pool.shape[2:])
        super().__init__(pool, torch.empty(shape, dtype=pool.dtype, pin_memory=pool.device.type == "cuda"),
                         on_drop, lower)
