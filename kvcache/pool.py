"""A cluster-wide KV pool: full blocks any worker computed, in a store every worker reaches (``kvcache.stores``).

- ``publish(key, block)``: a block just registered in this worker's prefix cache (its forward queued, perhaps not
  yet run) is copied into a free staging slot, queued on the device's stream with an event that marks its end, and
  a background thread puts it in the store once the copy has ended. With no free slot the block is not published
  (``unpublished``). Keys fetched from the pool, or published already, are not published again.
- ``match(keys)``: the longest run of ``keys`` the store holds, fetched at once; handles ``(pool, key)``. A block
  gone by the time it is fetched (dropped by the store, its owner gone) ends the run: the rest is computed again.
- ``load_many(pairs)``: each ``(key, block)``, the fetched bytes into the pool's ``block`` (``kvcache.load``);
  ``end_step`` drops what was fetched for a sequence that was not admitted after all.
- ``drain_published()``: the keys put in the store since the last call (the worker tells its routers, which weigh
  a prefix in the pool for every worker: ``router.policy``); ``info`` gives the measured fetch time a block
  (``pool_fetch_ms_per_block``) and the pool's size in blocks (``--kv-pool-bytes``), the routers' bound on what
  they remember of it.

Keys are named by the model and the block's shape and dtype (``namespace``): only workers of one model, with one
block layout, share blocks."""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    published: int = 0
    unpublished: int = 0  # no staging slot free when the block was registered
    loaded: int = 0
    missing: int = 0  # held when looked up, gone when fetched
    fetched: int = 0  # blocks read from the store (``fetch_ms``: the time their reads took)
    fetch_ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def namespace(model: str, pool: torch.Tensor) -> str:
    shape = "x".join(str(n) for n in (pool.shape[0], *pool.shape[2:]))
    return hashlib.sha1(f"{model}:{shape}:{pool.dtype}".encode()).hexdigest()[:16]


class PoolTier:
    name = "pool"

    def __init__(self, pool: torch.Tensor, store, space: str, staging: int = 64, capacity: int = 1 << 17):
        """``capacity``: the pool's size in blocks (what is worth remembering of it)."""
        self.pool, self.store, self.space, self.capacity = pool, store, space, capacity
        self.cuda = pool.device.type == "cuda"
        self.staging = torch.empty((staging, pool.shape[0], *pool.shape[2:]), dtype=pool.dtype,
                                   pin_memory=self.cuda)
        self.free = list(range(staging))
        self.known: OrderedDict[int, None] = OrderedDict()  # published here or fetched, the last ``capacity``
        self.published: list[int] = []  # put in the store since the last ``drain_published``
        self.fetched: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.stats = PoolStats()
        threading.Thread(target=self._publisher, name="kv-pool-publisher", daemon=True).start()

    def _name(self, key: int) -> str:
        return f"{self.space}:{key:x}"

    def publish(self, key: int, block: int) -> None:
        if key in self.known:
            return
        with self.lock:
            slot = self.free.pop() if self.free else None
        if slot is None:
            self.stats.unpublished += 1
            return
        self._know(key)
        self.staging[slot].copy_(self.pool[:, block], non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.queue.put((key, slot, event))

    def _publisher(self) -> None:
        while True:
            key, slot, event = self.queue.get()
            try:
                if event is not None:
                    event.synchronize()
                self.store.put(self._name(key), self.staging[slot].view(-1).view(torch.uint8).numpy())
                self.stats.published += 1
                with self.lock:
                    self.published.append(key)
            except Exception as e:  # the store is down or full: the block stays this worker's alone
                log.warning("KV pool: block %x not published: %r", key, e)
                with self.lock:
                    self.known.pop(key, None)
            finally:
                with self.lock:
                    self.free.append(slot)

    def _know(self, key: int) -> None:
        with self.lock:
            self.known[key] = None
            self.known.move_to_end(key)
            if len(self.known) > self.capacity:
                self.known.popitem(last=False)

    def drain_published(self) -> list[int]:
        with self.lock:
            out, self.published = self.published, []
        return out

    def keys(self) -> list[int]:
        """The keys this worker put in the pool or took from it (the last ``capacity``), for a new router."""
        with self.lock:
            return list(self.known)

    def match(self, keys: list[int]) -> list[tuple["PoolTier", int]]:
        names = [self._name(k) for k in keys]
        held = self.store.exists(names)
        run = next((i for i, h in enumerate(held) if not h), len(held))
        out, start = [], time.perf_counter()
        fetched = self.store.get(names[:run]) if run else []
        self.stats.fetch_ms += (time.perf_counter() - start) * 1e3
        self.stats.fetched += sum(data is not None for data in fetched)
        for key, data in zip(keys[:run], fetched):
            if data is None:
                self.stats.missing += 1
                break
            self.fetched[key] = data
            out.append((self, key))
        return out

    def pin_one(self, key: int) -> None:
        pass  # fetched already

    def load_many(self, pairs: list[tuple[int, int]]) -> None:
        for key, block in pairs:
            data = torch.from_numpy(np.asarray(self.fetched.pop(key))).view(self.pool.dtype)
            self.pool[:, block].copy_(data.view(self.pool[:, block].shape))
            self._know(key)
            self.stats.loaded += 1

    def end_step(self) -> None:
        self.fetched.clear()

    def info(self) -> dict:
        out = {f"pool_{k}": v for k, v in self.stats.to_dict().items()}
        out["pool_capacity_blocks"] = self.capacity
        if self.stats.fetched:
            out["pool_fetch_ms_per_block"] = self.stats.fetch_ms / self.stats.fetched
        return out
