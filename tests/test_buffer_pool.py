"""The transports' buffer pool: reuse, the cap on released buffers kept, and a full GPU handled as a failed
transfer (the allocation is faked: no GPU here)."""
import pytest
import torch

from kvtransfer import pool as pool_module
from kvtransfer.pool import BufferPool, PoolExhausted


def test_reuses_a_released_buffer_of_a_fitting_size():
    pool = BufferPool(1 << 20, pin=False)
    a = pool.acquire(1000)
    pool.release(a)
    b = pool.acquire(900)
    assert b.data_ptr() == a.data_ptr() and pool.reuses == 1 and pool.allocations == 1
    c = pool.acquire(100)  # a buffer over twice the size asked is not handed out
    assert pool.allocations == 2 and c.numel() == 100


def test_keeps_at_most_keep_bytes_of_released_buffers():
    pool = BufferPool(1 << 20, pin=False, keep_bytes=2500)
    bufs = [pool.acquire(n) for n in (1000, 3000, 1200)]
    assert pool.bytes_held == 5200
    for b in bufs:
        pool.release(b)
    # 1000 + 3000 passed the cap: the oldest went; then 3000 + 1200 too: 3000 went
    assert pool.bytes_held == 1200 and pool.bytes_in_use == 0
    assert pool.acquire(1100).numel() == 1200


def test_capacity_evicts_released_buffers_then_refuses():
    k = 10_000
    pool = BufferPool(40 * k, pin=False)
    a = pool.acquire(30 * k)
    pool.release(a)
    b = pool.acquire(25 * k)  # reuses a (within twice the size)
    pool.release(b)
    c = pool.acquire(10 * k)  # a is over twice the size: 30k held + 10k fits the capacity exactly
    assert pool.bytes_held == 40 * k and pool.allocations == 2
    with pytest.raises(PoolExhausted):
        pool.acquire(35 * k)  # the released 30k is dropped; 10k in use + 35k > 40k
    assert pool.bytes_held == 10 * k
    pool.release(c)


class FakeDevice:
    """``torch.empty`` on a pretend GPU with ``free`` bytes, and the allocator cache it can give back."""

    def __init__(self, free: int, cache: int = 0):
        self.free, self.cache, self.emptied = free, cache, 0

    def empty(self, n, dtype=None, device=None, pin_memory=False):
        if n > self.free:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
        self.free -= n
        return torch.zeros(n, dtype=dtype)

    def empty_cache(self):
        self.free, self.cache = self.free + self.cache, 0
        self.emptied += 1


def fake_gpu(monkeypatch, dev):
    monkeypatch.setattr(pool_module.torch, "empty", dev.empty)
    monkeypatch.setattr(pool_module.torch.cuda, "empty_cache", dev.empty_cache)


def test_full_gpu_gives_back_released_buffers_and_cache_then_retries(monkeypatch):
    dev = FakeDevice(free=3000)
    fake_gpu(monkeypatch, dev)
    pool = BufferPool(1 << 30, device="cuda")
    a = pool.acquire(2000)
    pool.release(a)
    dev.cache = 2000  # what dropping the released buffer returns to the allocator's cache
    b = pool.acquire(2800)  # 1000 free: the released 2000 is dropped, the cache emptied, and it fits
    assert b.numel() == 2800 and dev.emptied == 1 and pool.bytes_held == 2800


def test_full_gpu_after_retry_is_pool_exhausted_not_a_crash(monkeypatch):
    dev = FakeDevice(free=1000)
    fake_gpu(monkeypatch, dev)
    pool = BufferPool(1 << 30, device="cuda")
    with pytest.raises(PoolExhausted, match="no device memory for a 5000-byte transfer buffer"):
        pool.acquire(5000)
    assert dev.emptied == 1 and pool.bytes_held == 0 and pool.bytes_in_use == 0


def test_out_of_memory_on_the_host_is_not_swallowed(monkeypatch):
    dev = FakeDevice(free=10)
    fake_gpu(monkeypatch, dev)
    with pytest.raises(torch.OutOfMemoryError):
        BufferPool(1 << 30, pin=False).acquire(100)
    assert dev.emptied == 0
