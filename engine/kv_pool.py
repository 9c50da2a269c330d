"""The paged KV pool: per layer one K and one V tensor ``[num_blocks,
block_size, kv_heads, head_dim]``, views of one ``stacked`` tensor (K0, V0,
K1, ...) allocated once at start-up from the KV budget, so that a gather of
every layer is one copy. A sequence's KV in the canonical layout the transports carry
(per layer ``[tokens, kv_heads, head_dim]``) is its blocks' rows in order:
``pieces`` gives them as views (no copy) for transports that send or land
bytes in place, ``gather``/``scatter`` copy to and from whole tensors (of a
range of the pool's heads too: the slice one rank of a tensor-parallel
group exchanges with a rank of a group of another size)."""
from __future__ import annotations

import os

import torch

from .attention import block_slots
from .quant import kv_fp8


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device,
                 memory: torch.Tensor | None = None, scales: list | None = None):
        """``memory``: zeroed uint8 memory to lay the pool out in (e.g. shared with a transport); else allocated.
        ``scales``: per layer ``(k_scale, v_scale)`` of an FP8 pool (``quant.kv_fp8``; 1.0 when not given)."""
        shape = (num_blocks, block_size, kv_heads, head_dim)
        if memory is None:
            self.stacked = torch.zeros((2 * num_layers, *shape), dtype=dtype, device=device)
        else:
            n = 2 * num_layers * num_blocks * block_size * kv_heads * head_dim * dtype.itemsize
            self.stacked = memory[:n].view(dtype).view(2 * num_layers, *shape)
        self.layers = list(zip(self.stacked[0::2], self.stacked[1::2]))
        self.block_size = block_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.scales = None
        if dtype == kv_fp8.FP8:
            self.scales = [tuple(map(float, s)) for s in scales] if scales else [(1.0, 1.0)] * num_layers
        self.flat = [(k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)) for k, v in self.layers]

    def _slots(self, table: list[int], tokens: int) -> torch.Tensor:
        """The flat slots of the sequence's first ``tokens`` tokens, on the pool's device. Made on the host and, for a GPU,
        sent from pinned memory without blocking: a plain upload would wait for every step queued on the stream,
        so a copy between steps (a move's pause) would wait out the step in flight."""
        host = block_slots(torch.tensor(table, dtype=torch.long), self.block_size, tokens)
        if self.stacked.device.type != "cuda":
            return host
        return host.pin_memory().to(self.stacked.device, non_blocking=True)

    def spans(self, table: list[int], tokens: int) -> list[tuple[int, int]]:
        """Rows ``[start, end)`` of the flat pool (``flat``) holding the sequence's first ``tokens`` tokens, one
        span per run of consecutive block ids (the last cut to its tokens)."""
        spans, start = [], 0
        for i in range(1, len(table) + 1):
            if i == len(table) or table[i] != table[i - 1] + 1:
                t = min(i * self.block_size, tokens) - start * self.block_size
                if t > 0:
                    spans.append((table[start] * self.block_size, table[start] * self.block_size + t))
                start = i
        return spans

    def pieces(self, table: list[int], tokens: int) -> list:
        """Per layer ``(k_pieces, v_pieces)``: views of the sequence's blocks, one per span (``spans``)."""
        spans = self.spans(table, tokens)
        return [([kf[s:e] for s, e in spans], [vf[s:e] for s, e in spans]) for kf, vf in self.flat]

    def copy_block(self, src: int, dst: int) -> None:
        for k, v in self.layers:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def gather(self, table: list[int], tokens: int, into: list | None = None, heads: tuple | None = None) -> list:
        """The sequence's KV as canonical ``(k, v)`` per layer (written into ``into`` when given); ``heads``:
        only the pool's heads ``[first, end)``."""
        slots = self._slots(table, tokens)
        h0, h1 = heads or (0, self.kv_heads)
        rows = self.stacked.view(len(self.stacked), -1, self.kv_heads, self.head_dim)[:, :, h0:h1]
        if into is None:
            every = rows[:, slots]  # every layer's K and V in one launch
            return list(zip(every[0::2], every[1::2]))
        whole = _consecutive(into, (len(rows), len(slots), h1 - h0, self.head_dim), self.dtype)
        if whole is not None:  # one launch straight into the memory (a handoff or a move's pause waits on it)
            torch.index_select(_raw(rows), 1, slots, out=_raw(whole))
            return list(into)
        for i, pair in enumerate(into):
            for j, dest in enumerate(pair):
                if dest.dtype == self.dtype and dest.is_contiguous():
                    torch.index_select(_raw(rows[2 * i + j]), 0, slots, out=_raw(dest))
                else:
                    dest.copy_(rows[2 * i + j][slots])
        return list(into)

    def scatter(self, table: list[int], layers, heads: tuple | None = None, span: tuple | None = None) -> None:
        """Write canonical ``(k, v)`` layers (any device; any float dtype, cast, but FP8 into an FP8 pool only: its
        scales are the pool's, so convert first) into the sequence's blocks (``heads``: its heads ``[first, end)``;
        ``span``: only the pool's layers ``[first, end)``)."""
        it = iter(layers)
        first = next(it)
        tokens = first[0].shape[0]
        slots = self._slots(table, tokens)
        h0, h1 = heads or (0, self.kv_heads)
        l0, l1 = span or (0, len(self.layers))
        for (kc, vc), (k, v) in zip(self.layers[l0:l1], [first, *it], strict=True):
            for cache, new in ((kc, k), (vc, v)):
                if (cache.dtype == kv_fp8.FP8) != (new.dtype == kv_fp8.FP8):
                    raise ValueError(f"{new.dtype} KV into a {cache.dtype} pool: convert it first")
                kv_fp8.put(cache.view(-1, self.kv_heads, self.head_dim)[:, h0:h1], slots,
                           new.to(cache.device, cache.dtype))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte values (FP8) as bytes, which every device's index_select takes; others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _consecutive(into, shape, dtype) -> torch.Tensor | None:
    """``into``'s ``(k, v)`` tensors as one ``shape`` tensor where they lie back to back in the canonical order
    (as a transport's own memory hands them out) and hold ``dtype``, else None."""
    first = into[0][0]
    step = first.numel()
    if len(into) * 2 != shape[0] or tuple(first.shape) != tuple(shape[1:]) or first.dtype != dtype:
        return None
    for i, t in enumerate(t for pair in into for t in pair):
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape != first.shape
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != first.storage_offset() + i * step):
            return None
    return first.as_strided(shape, (step, *first.stride()), first.storage_offset())


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``; on a GPU after the allocator gives back what it caches unused (loading leaves
    freed temporaries there: a dummy checkpoint draws each tensor whole before its shard is kept)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
