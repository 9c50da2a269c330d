"""First-fit allocator over one preallocated byte tensor (e.g. a shared-memory
segment): regions are carved out and returned, the memory is mapped once."""
from __future__ import annotations

import threading

import torch

from .pool import PoolExhausted

ALIGN = 4096


class Arena:
    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, memory.numel())]
        self._used: dict[int, int] = {}

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    self._used[off] = size
                    return off, self.memory[off:off + nbytes]
        raise PoolExhausted(f"shared-memory arena full: {self.bytes_in_use} of {self.memory.numel()} bytes in use, "
                            f"{nbytes} requested")

    def release(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)
            self._free.append((offset, size))
            self._free.sort()
            merged = [self._free[0]]
            for off, length in self._free[1:]:
                last_off, last_len = merged[-1]
                if last_off + last_len == off:
                    merged[-1] = (last_off, last_len + length)
                else:
                    merged.append((off, length))
            self._free = merged

    @property
    def bytes_in_use(self) -> int:
        return sum(self._used.values())
