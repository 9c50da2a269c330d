"""Buffer pool: destination (and staging) buffers are allocated once and
reused across transfers, so steady state does no allocation or registration.
``allocations`` counts real allocations; a transport that must register memory
with a NIC does it once per pool buffer, never per request.

A pool on a GPU shares the device with the engine: it keeps at most
``keep_bytes`` of released buffers (KVs of many sizes would otherwise leave a
buffer of each size behind, up to the capacity), and when an allocation finds
the device full it gives back every released buffer and the allocator's
unused cache and tries once more, then raises ``PoolExhausted`` (a failed
transfer, not a dead worker)."""
from __future__ import annotations

import threading

import torch


class PoolExhausted(MemoryError):
    pass


class BufferPool:
    def __init__(self, capacity_bytes: int, pin: bool | None = None, on_allocate=None, device="cpu",
                 keep_bytes: int | None = None):
        self.capacity_bytes = capacity_bytes
        self.keep_bytes = capacity_bytes if keep_bytes is None else keep_bytes
        self.device = torch.device(device)
        self.pin = self.device.type == "cpu" and (torch.cuda.is_available() if pin is None else pin)
        self.on_allocate = on_allocate
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._held = 0
        self._kept = 0  # bytes of the released buffers in _free
        self.allocations = 0
        self.reuses = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of at least ``nbytes``; view ``[:nbytes]`` of it."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes + 4096]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._kept -= buf.numel()
                self.reuses += 1
            else:
                while self._held + nbytes > self.capacity_bytes and self._free:
                    self._drop_oldest()
                if self._held + nbytes > self.capacity_bytes:
                    raise PoolExhausted(f"buffer pool full: {self._held} of {self.capacity_bytes} bytes held, {nbytes} requested")
                buf = self._allocate(nbytes)
                self._held += nbytes
                self.allocations += 1
                if self.on_allocate:
                    self.on_allocate(buf)
            self._in_use += buf.numel()
            return buf

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        except torch.OutOfMemoryError as e:
            if self.device.type != "cuda":
                raise
            first = e
        while self._free:
            self._drop_oldest()
        torch.cuda.empty_cache()
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            raise PoolExhausted(f"no device memory for a {nbytes}-byte transfer buffer on {self.device} "
                                f"({self._in_use} bytes in use by other transfers): {first}") from None

    def _drop_oldest(self) -> None:
        buf = self._free.pop(0)
        self._held -= buf.numel()
        self._kept -= buf.numel()

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._in_use -= buf.numel()
            self._free.append(buf)
            self._kept += buf.numel()
            while self._kept > self.keep_bytes:
                self._drop_oldest()

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    @property
    def bytes_held(self) -> int:
        return self._held
