"""KV in pieces: each layer's K and V as lists of contiguous tensors whose
concatenation along the token axis is the canonical ``[tokens, kv_heads,
head_dim]`` tensor. This is how the blocks of a paged KV pool look without
copying them: a sender that ``sends_pieces`` moves them straight from the
blocks (tcp: one ``sendmsg`` iov each; shm: one copy each into the granted
region), and a receiver's ``land`` hook can name pieces for a transfer's
bytes to be received into (tcp: ``recv_into`` each), so they arrive in the
blocks that will hold them."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import frames
from .layout import KVLayout
from .pool_rows import PoolRows
from .tensors import TORCH_DTYPES, as_bytes


@dataclass
class PiecewiseKV:
    """``gate``: set while the KV is still being computed (layer-wise streaming): ``gate.host_wait(i)`` blocks until
    layer ``i`` is written (on a GPU: until its event completed). Senders call ``ready(i)`` before reading layer
    ``i``."""
    layout: KVLayout
    layers: list  # per layer (k_pieces, v_pieces): a list, or a ``PoolRows`` (pieces on demand, copies by index)
    gate: object = None

    def ready(self, layer: int) -> float:
        """Seconds spent waiting until layer ``layer`` can be read from the host."""
        if self.gate is None:
            return 0.0
        start = time.perf_counter()
        self.gate.host_wait(layer)
        return time.perf_counter() - start

    def __len__(self) -> int:
        return len(self.layers)

    def check(self) -> "PiecewiseKV":
        dtype, shape = TORCH_DTYPES[self.layout.dtype], self.layout.tensor_shape
        if len(self.layers) != self.layout.num_layers:
            raise ValueError(f"{len(self.layers)} layers, layout declares {self.layout.num_layers}")
        if isinstance(self.layers, PoolRows):
            self.layers.check(dtype, shape)
            return self
        for k_pieces, v_pieces in self.layers:
            for pieces in (k_pieces, v_pieces):
                if sum(p.shape[0] for p in pieces) != shape[0]:
                    raise ValueError(f"pieces hold {sum(p.shape[0] for p in pieces)} tokens, layout {shape[0]}")
                for p in pieces:
                    if p.dtype != dtype or tuple(p.shape[1:]) != shape[1:] or not p.is_contiguous():
                        raise ValueError(f"piece {tuple(p.shape)} {p.dtype} does not fit layout {shape} {dtype}")
        return self

    def parts(self, layer: int) -> list[memoryview]:
        """Byte views of layer ``layer``: K's pieces then V's (host memory only)."""
        k_pieces, v_pieces = self.layers[layer]
        return [as_bytes(p) for p in (*k_pieces, *v_pieces)]

    def whole(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V as one tensor (a copy unless a layer is one piece)."""
        return [(ks[0] if len(ks) == 1 else torch.cat(ks), vs[0] if len(vs) == 1 else torch.cat(vs))
                for ks, vs in self.layers]


@dataclass
class Landing:
    """Where a receiver puts a transfer's bytes (``kv``), and what undoes the reservation if the transfer never
    completes or is never used (``release``, idempotent on the caller's side)."""
    kv: PiecewiseKV
    release: Callable[[], None]


def block_map(kv: PiecewiseKV, memory: torch.Tensor, absolute: bool = False) -> dict | None:
    """``{bases, rel, sizes}`` locating ``kv``'s pieces in ``memory`` (offsets into it, or addresses with
    ``absolute``): layer ``i``'s K pieces at ``bases[i][0] + rel[j]``, ``sizes[j]`` bytes each, V's at
    ``bases[i][1] + rel[j]``. None when the pieces are not one set of offsets repeated in every layer."""
    origin = 0 if absolute else memory.data_ptr()

    def offsets(pieces):
        return [p.data_ptr() - origin for p in pieces]

    first = kv.layers[0][0]
    rel = [o - offsets(first)[0] for o in offsets(first)]
    sizes = [p.numel() * p.element_size() for p in first]
    bases = []
    for k_pieces, v_pieces in kv.layers:
        pair = []
        for pieces in (k_pieces, v_pieces):
            offs = offsets(pieces)
            if [o - offs[0] for o in offs] != rel or [p.numel() * p.element_size() for p in pieces] != sizes:
                return None
            pair.append(offs[0])
        bases.append(pair)
    low, high = (memory.data_ptr(), memory.data_ptr() + memory.numel()) if absolute else (0, memory.numel())
    if any(b + r < low or b + r + s > high for pair in bases for b in pair for r, s in zip(rel, sizes)):
        return None
    return {"bases": bases, "rel": rel, "sizes": sizes}


def block_runs(grant: dict, layout, segment_bytes: int | None = None) -> list:
    """Per layer ``(k_runs, v_runs)`` of ``(offset, nbytes)`` from a ``block_map`` GRANT, checked against the layout
    (and the segment, when its size is given)."""
    bases, rel, sizes = grant.get("bases"), grant.get("rel"), grant.get("sizes")
    ok = (isinstance(bases, list) and isinstance(rel, list) and isinstance(sizes, list) and len(rel) == len(sizes)
          and len(bases) == layout.num_layers and sum(s for s in sizes if isinstance(s, int)) == layout.tensor_nbytes)
    if not ok or any(not isinstance(x, int) for x in rel) or any(not isinstance(x, int) or x < 0 for x in sizes):
        raise frames.FrameError("block GRANT does not match the layout")
    out = []
    for pair in bases:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(b, int) and b >= 0 for b in pair)):
            raise frames.FrameError("block GRANT with a bad base")
        runs = tuple([(b + r, s) for r, s in zip(rel, sizes)] for b in pair)
        if segment_bytes is not None and any(off < 0 or off + n > segment_bytes for side in runs for off, n in side):
            raise frames.FrameError("block GRANT outside the segment")
        out.append(runs)
    return out


def piece_tokens(kv: PiecewiseKV) -> list[int]:
    """Tokens in each piece (the same in every layer, K and V alike: pieces come from one block table)."""
    if isinstance(kv.layers, PoolRows):
        return kv.layers.piece_tokens()
    return [p.shape[0] for p in kv.layers[0][0]]


def valid_piece_tokens(value, tokens: int) -> list[int]:
    """A peer's piece sizes, checked: positive ints that add up to ``tokens``."""
    if not (isinstance(value, list) and 0 < len(value) <= tokens
            and all(isinstance(n, int) and n > 0 for n in value) and sum(value) == tokens):
        raise frames.FrameError("piece sizes do not add up to the layout's tokens")
    return value


def common_cuts(a: list[int], b: list[int]) -> list[int]:
    """Segment sizes that split both ``a``'s and ``b``'s pieces at every boundary of either."""
    ends = sorted({*itertools.accumulate(a), *itertools.accumulate(b)})
    return [e - s for s, e in zip([0, *ends], ends)]


def segments(pieces: list, cuts: list[int]) -> list:
    """``pieces`` (tensors along the token axis) cut into contiguous views of ``cuts`` tokens each."""
    out, it = [], iter(pieces)
    piece, at = next(it), 0
    for n in cuts:
        if at == piece.shape[0]:
            piece, at = next(it), 0
        out.append(piece[at:at + n])
        at += n
    return out
