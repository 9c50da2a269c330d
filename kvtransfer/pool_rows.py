"""A sequence's KV where a paged pool holds it, as the ``layers`` of a
``PiecewiseKV``: per layer the pool's flat K and V tensors
(``[pool_rows, kv_heads, head_dim]``) and the spans of rows the sequence
occupies, one per run of consecutive blocks.

Indexing gives a layer's ``(k_pieces, v_pieces)`` (one view a span, made
when asked), so every transport that moves pieces takes it as it takes a
list. A copy of the whole KV into or out of one canonical buffer (the NCCL
transport's gather on the sender and scatter on the receiver) goes by index
instead when the spans are many (``index_above``): one ``index_select`` /
``index_copy_`` per layer and side over the rows' slots, in 8-byte words,
whatever the number of spans (one H200, Mistral-7B's 7,040-token KV, a
gather and a scatter: 136 ms by views in 440 spans, 13.7 ms by index even
copying byte by byte; by views 1.5 ms in one span, 4.1 in eight). After much churn a pool's blocks
come back in many runs (before ``BlockManager`` sorted what it hands out, a
7k-token Mistral-7B KV was 440 single-block spans: 28,000 views to make,
check and copy, tens of milliseconds of Python holding the GIL on both
workers of every transfer)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

INDEX_ABOVE_RUNS = 8  # up to this many spans a copy goes by views (one H200: 1.5 ms for 1 span, 4.1 for 8)


class PoolRows(Sequence):
    def __init__(self, flat: list, spans: list[tuple[int, int]], index_above: int = INDEX_ABOVE_RUNS):
        """``index_above``: copies go by index when there are more spans than this (else by views)."""
        self.flat, self.spans, self.index_above = list(flat), list(spans), index_above
        self._slots: dict = {}

    @property
    def by_index(self) -> bool:
        return len(self.spans) > self.index_above

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, i):
        if isinstance(i, slice):
            rows = PoolRows(self.flat[i], self.spans, self.index_above)
            rows._slots = self._slots
            return rows
        k, v = self.flat[i]
        return [k[s:e] for s, e in self.spans], [v[s:e] for s, e in self.spans]

    @property
    def tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def piece_tokens(self) -> list[int]:
        return [e - s for s, e in self.spans]

    def check(self, dtype, shape: tuple) -> None:
        """Raise unless these rows are ``shape`` (``[tokens, heads, dim]``) of ``dtype`` in every layer."""
        if self.tokens != shape[0]:
            raise ValueError(f"pool rows hold {self.tokens} tokens, layout {shape[0]}")
        for k, v in self.flat:
            for t in (k, v):
                if t.dtype != dtype or tuple(t.shape[1:]) != tuple(shape[1:]) or not t.is_contiguous():
                    raise ValueError(f"pool {tuple(t.shape)} {t.dtype} does not fit layout {shape} {dtype}")
        if self.flat and any(s < 0 or e > self.flat[0][0].shape[0] or s >= e for s, e in self.spans):
            raise ValueError("pool rows outside the pool")

    def slots(self, device) -> torch.Tensor:
        """Every token's row, in order (int64 on ``device``; made once per device)."""
        key = str(device)
        if key not in self._slots:
            starts = torch.tensor([s for s, _ in self.spans], dtype=torch.long)
            sizes = torch.tensor(self.piece_tokens(), dtype=torch.long)
            offsets = torch.cumsum(sizes, 0) - sizes
            within = torch.arange(self.tokens, dtype=torch.long) - torch.repeat_interleave(offsets, sizes)
            self._slots[key] = (torch.repeat_interleave(starts, sizes) + within).to(device)
        return self._slots[key]

    def copy_out(self, layer_rows) -> None:
        """Layer ``i``'s K and V rows into ``layer_rows(i)``'s two tensors (``[tokens, ...]``, any dtype)."""
        for i, (k, v) in enumerate(self.flat):
            index = self.slots(k.device)
            for src, dst in zip((k, v), layer_rows(i)):
                torch.index_select(as_bytes_rows(src), 0, index, out=as_bytes_rows(dst))

    def copy_in(self, layer_rows) -> None:
        """``layer_rows(i)``'s two tensors into layer ``i``'s K and V rows."""
        for i, (k, v) in enumerate(self.flat):
            index = self.slots(k.device)
            for dst, src in zip((k, v), layer_rows(i)):
                as_bytes_rows(dst).index_copy_(0, index, as_bytes_rows(src))


def as_bytes_rows(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` of any dtype as ``[rows, words]`` of the widest integer that divides a row (the same memory:
    an indexed copy moves 8-byte words, not bytes)."""
    row = t.view(t.shape[0], -1).view(torch.uint8)
    for wide in (torch.int64, torch.int32, torch.int16):
        if row.shape[1] % wide.itemsize == 0:
            return row.view(wide)
    return row
