"""The disk tier (``--kv-disk DIR --kv-disk-bytes SIZE``): under the host tier, what it drops goes to a file mapped
into memory (the page cache in front of the disk), each block checksummed as written and checked before it is read;
a block whose checksum fails is dropped and computed again. Reads are timed (``disk_read_ms_per_block``): the
routers weigh a block on disk by what reading it saves against computing it."""
from __future__ import annotations

import os
import time
import weakref
import zlib

import torch

from .tiers import Tier


class DiskTier(Tier):
    """Slots in a file under ``directory``, mapped into memory (the page cache in front of the disk), each with the
    CRC-32 of its bytes as written, checked before it is read. The file is removed when the tier goes."""
    name = "disk"

    def __init__(self, pool: torch.Tensor, capacity: int, directory: str, on_drop=None):
        shape = (capacity, pool.shape[0], *pool.shape[2:])
        nbytes = capacity * pool[:, 0].numel() * pool.element_size()
        self.path = os.path.join(directory, f"pdserve-kv-{os.getpid()}-{id(self):x}.bin")
        with open(self.path, "wb") as f:
            f.truncate(nbytes)
        weakref.finalize(self, _remove, self.path)
        raw = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        super().__init__(pool, raw.view(pool.dtype).view(shape), on_drop)
        self.sums: dict[int, int] = {}
        self.read_ms, self.read = 0.0, 0  # the time blocks took to come off the disk (checked and copied out)

    def match(self, keys: list[int]) -> list[tuple["Tier", int]]:
        start = time.perf_counter()
        out = super().match(keys)
        self.read_ms += (time.perf_counter() - start) * 1e3  # the checksums read every matched block
        return out

    def load_many(self, pairs: list[tuple[int, int]]) -> None:
        start = time.perf_counter()
        super().load_many(pairs)  # from memory that is not pinned: the copy ends before it returns
        self.read_ms += (time.perf_counter() - start) * 1e3
        self.read += len(pairs)

    def info(self) -> dict:
        out = super().info()
        if self.read:
            out["disk_read_ms_per_block"] = self.read_ms / self.read
        return out

    def _write(self, slot: int, source: torch.Tensor) -> None:
        self.slots[slot].copy_(source)
        self.sums[slot] = self._crc(slot)

    def _crc(self, slot: int) -> int:
        return zlib.crc32(self.slots[slot].view(torch.uint8).numpy())

    def _intact(self, slot: int) -> bool:
        return self.sums.get(slot) == self._crc(slot)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
