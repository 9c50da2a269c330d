"""First-fit allocator over one preallocated byte tensor (e.g. a shared-memory
segment): regions are carved out and returned, the memory is mapped once."""
from __future__ import annotations

import threading

import torch

from .base import SourceKV
from .pool import PoolExhausted
from .tensors import TORCH_DTYPES, unpack

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

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is contiguous and lies inside this arena's memory."""
        if not isinstance(t, torch.Tensor):
            return False
        start = t.data_ptr() - self.memory.data_ptr()
        end = start + t.numel() * t.element_size()
        return t.device == self.memory.device and t.is_contiguous() and 0 <= start and end <= self.memory.numel()

    def source(self, layout) -> SourceKV | None:
        """A region for ``layout`` as typed ``(k, v)`` views, or None when the arena is full."""
        try:
            offset, region = self.acquire(layout.total_nbytes)
        except PoolExhausted:
            return None
        return SourceKV(layout, unpack(region, layout), lambda: self.release(offset), self, offset)

    def region_of(self, layout, layers) -> int | None:
        """The offset of the region that ``layers`` fill in the canonical order (as
        ``source`` hands them out), checked against ``layout``; None if they do not."""
        if isinstance(layers, SourceKV) and layers.owner is self and not layers.released:
            return layers.offset if layers.layout == layout else None
        if not isinstance(layers, (list, tuple)) or len(layers) != layout.num_layers:
            return None
        dtype, shape, step = TORCH_DTYPES[layout.dtype], layout.tensor_shape, layout.tensor_nbytes
        first = layers[0][0]
        if not self.holds(first) or not self.holds(layers[-1][1]):
            return None
        expected = first.data_ptr()
        for pair in layers:
            for t in pair:
                if t.data_ptr() != expected or t.dtype != dtype or t.shape != shape or not t.is_contiguous():
                    return None
                expected += step
        return first.data_ptr() - self.memory.data_ptr()
