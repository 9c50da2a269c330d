"""KV in pieces: each layer's K and V as lists of contiguous tensors whose
concatenation along the token axis is the canonical ``[tokens, kv_heads,
head_dim]`` tensor. This is how the blocks of a paged KV pool look without
copying them: a sender that ``sends_pieces`` moves them straight from the
blocks (tcp: one ``sendmsg`` iov each; shm: one copy each into the granted
region), and a receiver's ``land`` hook can name pieces for a transfer's
bytes to be received into (tcp: ``recv_into`` each), so they arrive in the
blocks that will hold them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .layout import KVLayout
from .tensors import TORCH_DTYPES, as_bytes


@dataclass
class PiecewiseKV:
    layout: KVLayout
    layers: list

    def __len__(self) -> int:
        return len(self.layers)

    def check(self) -> "PiecewiseKV":
        dtype, shape = TORCH_DTYPES[self.layout.dtype], self.layout.tensor_shape
        if len(self.layers) != self.layout.num_layers:
            raise ValueError(f"{len(self.layers)} layers, layout declares {self.layout.num_layers}")
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
