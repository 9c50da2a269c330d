"""A cluster-wide KV pool: full blocks any worker computed, in a store every worker reaches (``kvcache.stores``).

- ``publish(key, block)``: a block just registered in this worker's prefix cache (its forward queued, perhaps not
  yet run) is copied into a free staging slot, queued on the device's stream with an event that marks its end, and
  a background thread puts it in the store once the copy has ended. With no free slot the block is not published
  (``unpublished``). Keys fetched from the pool, or published already, are not published again.
- ``match(keys)``: the longest run of ``keys`` the store holds, fetched at once; handles ``(pool, key)``. A block
  gone by the time it is fetched (dropped by the store, its owner gone) ends the run: the rest is computed again.
- ``load_many(pairs)``: each ``(key, block)``, the fetched bytes into the pool's ``block`` (``kvcache.load``);
  ``end_step`` drops what was fetched for a sequence that was not admitted after all.

Keys are named by the model and the block's shape and dtype (``namespace``): only workers of one model, with one
block layout, share blocks."""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
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

    def to_dict(self) -> dict:
        return asdict(self)


def namespace(model: str, pool: torch.Tensor) -> str:
    shape = "x".join(str(n) for n in (pool.shape[0], *pool.shape[2:]))
    return hashlib.sha1(f"{model}:{shape}:{pool.dtype}".encode()).hexdigest()[:16]


class PoolTier:
    name = "pool"

    def __init__(self, pool: torch.Tensor, store, space: str, staging: int = 64):
        self.pool, self.store, self.space = pool, store, space
        self.cuda = pool.device.type == "cuda"
        self.staging = torch.empty((staging, pool.shape[0], *pool.shape[2:]), dtype=pool.dtype,
                                   pin_memory=self.cuda)
        self.free = list(range(staging))
        self.known: set[int] = set()  # published here or fetched from the pool
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
        self.known.add(key)
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
            except Exception as e:  # the store is down or full: the block stays this worker's alone
                log.warning("KV pool: block %x not published: %r", key, e)
                self.known.discard(key)
            finally:
                with self.lock:
                    self.free.append(slot)

    def match(self, keys: list[int]) -> list[tuple["PoolTier", int]]:
        names = [self._name(k) for k in keys]
        held = self.store.exists(names)
        run = next((i for i, h in enumerate(held) if not h), len(held))
        out = []
        for key, data in zip(keys[:run], self.store.get(names[:run])):
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
            self.known.add(key)
            self.stats.loaded += 1

    def end_step(self) -> None:
        self.fetched.clear()

    def info(self) -> dict:
        return {f"pool_{k}": v for k, v in self.stats.to_dict().items()}
