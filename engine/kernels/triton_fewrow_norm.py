"""The residual add + RMSNorm between two few-row projections, split into their epilogues (CUDA; decode at 2-32 rows).

A decoder layer runs ``o -> add + RMSNorm -> gate/up`` and ``down -> add +
RMSNorm -> q/k/v`` (the next layer's). At a few rows the norm is a launch of
its own (~2 us, twice a layer). The norm needs each row's RMS over all its
columns, which no program of either projection sees, but it factors:
``rmsnorm(s) W^T = (1 / RMS(s)) * ((s * g) W^T)`` row by row, ``s`` the sum
with the residual and ``g`` the norm's weight. So:

* the projection before (o, down) does not launch when it is called: it
  returns ``Pending``, and the RMSNorm it reaches launches it with the first
  half in its epilogue (``NormPart(prep=True)``): each output block adds the
  residual (rounded as ``add_rmsnorm`` rounds it) and writes the sum for the
  residual stream, writes ``s * g`` as the next projection's input and adds
  its columns' ``s^2`` into a per-row fp32 buffer (atomics);
* the norm returns ``Prenormed`` (and the sum), and the projection after it
  (q/k/v, gate/up) multiplies ``s * g`` and scales each row's sums by
  ``rsqrt(mean(s^2) + eps)`` in its epilogue; its last program zeroes the
  buffer for the next norm (a ticket over the whole grid).

Rounding differs from ``RMSNorm`` then ``F.linear`` only in where the
scale is applied (bf16 noise). Only between two layers of one model part:
the last layer's down feeds the final norm (or a pipeline stage's send),
which run as before; a row-parallel o (tensor parallelism) all-reduces
before the add, so it keeps the plain path."""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import triton_fewrow as fewrow

NORM_ROWS = fewrow.NORM_ROWS
CONSUMER = fewrow.FewRowConfig(64, 128, 4, 4)  # gate/up's tile here (cuBLAS's otherwise): 1% behind it on an H200


class Prenormed(NamedTuple):
    """Rows ``s * g`` of an RMSNorm whose ``1 / RMS(s)`` is still to apply (``squares``: ``sum(s^2)`` per row)."""
    x: torch.Tensor
    squares: torch.Tensor
    eps: float


class Pending(NamedTuple):
    """``layer(x)`` not launched yet: the RMSNorm after it launches it with its first half (``norm_after``)."""
    x: torch.Tensor
    layer: torch.nn.Module

    def norm_after(self, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """``(Prenormed, sum)`` for ``rmsnorm(layer(x) + residual) * weight`` (None without a residual: then the
        norm runs ``resolve()`` and itself)."""
        if residual is None:
            return None
        x, n = self.x, self.layer.weight.shape[0]
        out, total = (torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) for _ in range(2))
        squares = fewrow._SQUARES[x.device]
        part = fewrow.NormPart(True, squares, eps, residual.contiguous(), weight, total)
        fewrow.matmul(x, self.layer.weight, _config(x.shape[0], self.layer), out, bias=self.layer.bias, norm=part)
        return Prenormed(out, squares, eps), total

    def resolve(self) -> torch.Tensor:
        return fewrow.linear(self.x, self.layer)


def takes(x, layer) -> bool:
    """Whether ``linear`` runs ``layer`` on ``x`` (``Prenormed`` rows, or rows ``triton_fewrow`` takes)."""
    return isinstance(x, Prenormed) or fewrow.takes(x, layer)


def linear(x, layer):
    """``layer(x)``: on ``Prenormed`` rows with the RMS scale in the epilogue; for the projection before a norm
    (``layer.norm_follows``) at 2-``NORM_ROWS`` rows, ``Pending``; else ``triton_fewrow.linear``."""
    if isinstance(x, Prenormed):
        n = layer.weight.shape[0]
        out = torch.empty(x.x.shape[0], n, dtype=x.x.dtype, device=x.x.device)
        config = fewrow.config_for(x.x.shape[0], n, layer.weight.shape[1], fewrow.kind_of(x.x.dtype)) or CONSUMER
        fewrow.matmul(x.x, layer.weight, config, out, bias=layer.bias, norm=fewrow.NormPart(False, x.squares, x.eps))
        return out
    if getattr(layer, "norm_follows", False) and 2 <= x.shape[0] <= NORM_ROWS and fewrow.counters(x.device) is not None:
        return Pending(x.contiguous(), layer)
    return fewrow.linear(x, layer)


def _config(rows: int, layer) -> fewrow.FewRowConfig:
    n, k = layer.weight.shape
    return fewrow.config_for(rows, n, k, fewrow.kind_of(layer.weight.dtype)) or CONSUMER
