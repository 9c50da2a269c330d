"""Decode projections for a few rows with their neighbours fused, as one Triton kernel (CUDA).

At batch 1 a decode step reads every weight once; what it spends beyond
that is launches. Between two GEMVs of a layer sat a norm (with the residual
add), SiLU-times-up or, with FP8 weights, the activations' quantization,
each about 2 us however small, and the narrow projections (q/k/v, o) read
at 75-78% of the bandwidth through cuBLAS. Here one program owns
``BLOCK_N`` output channels and walks all of K, the weight tile as the left
operand of a tensor-core product and the rows (at most ``MAX_ROWS``, padded
to 16) as the right one ("swap AB"), with:

* prologue ``NORM``: the rows are ``rmsnorm(x [+ residual])`` computed as
  they are read (a first pass over the rows, from L2, finds each row's
  scale; program 0 also writes the sum for the residual stream): an RMSNorm
  hands ``Normed`` to the projection instead of launching (``defer``);
* prologue ``FP8`` (e4m3 weights with per-channel scales): the rows are
  quantized per row as they are read (another pass finds max|x|), then
  multiplied in FP8: the numbers of ``quantize_rows`` + ``_scaled_mm``;
* epilogue ``SILU``: the program reads gate rows ``n`` and up rows ``N + n``
  and writes ``silu(gate) * up``: the MLP is two launches;
* programmatic dependent launch (``triton_pdl``, Hopper+), as the
  attention kernels between the projections: the gaps between launches are
  hidden.

Every value is rounded where the torch forms round (``RMSNorm``, ``MLP``,
``Fp8Linear``); only the order of the sums differs from cuBLAS. Tiles:
``config_for`` (``pdserve bench kernels --only fused --sweep`` measures
them; ``PDSERVE_FEW_ROWS_CONFIGS`` names a JSON of its picks to use).
``PDSERVE_FEW_ROWS=0`` turns the kernels off (the A/B)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_pdl import ENABLED as PDL, launch_options

MAX_ROWS = min(16, int(os.environ.get("PDSERVE_FEW_ROWS", "16")))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP8 = torch.float8_e4m3fn


class Normed(NamedTuple):
    """``rmsnorm(x [+ residual]) * weight``, not computed yet: the projection after the norm computes it as it
    reads the rows (``total``: where the sum ``x + residual`` goes, for the residual stream)."""
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    total: torch.Tensor | None


@dataclass(frozen=True)
class FewRowsConfig:
    block_n: int = 16
    block_k: int = 512
    warps: int = 4
    stages: int = 4


def takes(x) -> bool:
    """Whether these kernels run ``x``: a deferred norm, or a few rows of a 2-D CUDA tensor in bf16/fp16 (fp32
    stays with torch: the tensor cores would multiply it in tf32; the interpreter, in tests, takes it)."""
    if isinstance(x, Normed):
        return True
    if not isinstance(x, torch.Tensor):  # ``Quantized`` rows (more than a few, before an FP8 projection)
        return False
    half = x.dtype in (torch.bfloat16, torch.float16)
    return (x.is_cuda and half or INTERPRETED and (half or x.dtype == torch.float32)) and x.dim() == 2 \
        and 0 < x.shape[0] <= MAX_ROWS


def defer(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """What ``RMSNorm.forward`` returns for a few rows: ``Normed`` (with ``residual``: and the sum's tensor)."""
    x = x.contiguous()
    if residual is None:
        return Normed(x, None, weight, eps, None)
    total = torch.empty_like(x)
    return Normed(x, residual.contiguous(), weight, eps, total), total


@triton.jit
def _rows(x_ptr, r_ptr, nw_ptr, m, k, mmask, kmask, K, rs, xs, ADD: tl.constexpr, NORM: tl.constexpr,
          QUANT: tl.constexpr, dt: tl.constexpr):
    """The rows' inputs at columns ``k``, transposed ``[BLOCK_K, BLOCK_M]``, in fp32: ``x`` (+ residual, rounded),
    normed (rounded as ``RMSNorm``), divided by the row's FP8 scale and saturated."""
    offs = m[None, :] * K + k[:, None]
    mask = mmask[None, :] & kmask[:, None]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        v = (v + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if NORM:
        v = (v * rs[None, :]).to(dt).to(tl.float32)
        v = (tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)[:, None] * v).to(dt).to(tl.float32)
    if QUANT:
        v = tl.minimum(tl.maximum(v / xs[None, :], -448.0), 448.0)
    return v


@triton.jit
def _dot(w, xt, acc, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies no FP8 / bf16
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32))
    return tl.dot(w, xt, acc)


@triton.jit(do_not_specialize=["M", "eps"])
def _few_rows_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, eps,
                     N: tl.constexpr, K: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                     SILU: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    kk = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_wait()  # the rows are the kernel before's output
    rs = tl.full([BLOCK_M], 1.0, tl.float32)
    xs = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:  # each row's RMS scale; program 0 writes the residual sum on the way
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            kmask = k < K
            v = _rows(x_ptr, r_ptr, nw_ptr, m, k, mmask, kmask, K, rs, xs, ADD, False, False, dt)
            if ADD:
                if pid == 0:
                    tl.store(sum_ptr + m[None, :] * K + k[:, None], v.to(dt), mask=mmask[None, :] & kmask[:, None])
            ss += tl.sum(v * v, axis=0)
        rs = tl.rsqrt(ss / K + eps)
    if FP8:  # each row's e4m3 scale: max|row| / 448
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            v = _rows(x_ptr, r_ptr, nw_ptr, m, k, mmask, k < K, K, rs, xs, ADD, NORM, False, dt)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
        xs = tl.maximum(amax / 448.0, 1e-12)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # transposed: output channels down, rows across
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    wdt = w_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        xt = _rows(x_ptr, r_ptr, nw_ptr, m, k, mmask, kmask, K, rs, xs, ADD, NORM, FP8, dt).to(wdt)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=wmask, other=0.0)
        acc = _dot(w, xt, acc, UPCAST)
        if SILU:
            w = tl.load(w_ptr + (n[:, None] + N).to(tl.int64) * K + k[None, :], mask=wmask, other=0.0)
            acc_up = _dot(w, xt, acc_up, UPCAST)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if FP8:
        acc = acc * tl.load(ws_ptr + n, mask=nmask, other=0.0)[:, None] * xs[None, :]
        if SILU:
            acc_up = acc_up * tl.load(ws_ptr + N + n, mask=nmask, other=0.0)[:, None] * xs[None, :]
    y = acc.to(dt).to(tl.float32)
    if BIAS:
        y = (y + tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]).to(dt).to(tl.float32)
    if SILU:  # rounded as the gate/up GEMM's output, then as ``triton_layers.silu_mul``
        up = acc_up.to(dt).to(tl.float32)
        if BIAS:
            up = (up + tl.load(b_ptr + N + n, mask=nmask, other=0.0).to(tl.float32)[:, None]).to(dt).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32) * up
    tl.store(out_ptr + m[None, :] * N + n[:, None], y.to(dt), mask=mmask[None, :] & nmask[:, None])


def linear(x, layer, silu: bool = False, config: FewRowsConfig | None = None) -> torch.Tensor:
    """``layer(x)`` for a few rows (``x``: a tensor ``[rows, K]`` or ``Normed``); ``layer``: an ``nn.Linear``
    (a row-parallel one all-reduces after) or an ``Fp8Linear``. ``silu``: ``layer`` is the fused gate/up
    projection and the result is ``silu(gate) * up``."""
    normed = isinstance(x, Normed)
    rows = x.x if normed else x.contiguous()
    dtype = rows.dtype
    fp8 = layer.weight.dtype == FP8
    n_total, k = layer.weight.shape
    n = n_total // 2 if silu else n_total
    out = torch.empty(rows.shape[0], n, dtype=dtype, device=rows.device)
    add = normed and x.residual is not None
    c = config or config_for(n, k, silu, fp8)
    args = (rows, x.residual if add else rows, x.weight if normed else rows, x.total if add else out, layer.weight,
            layer.weight_scale if fp8 else layer.weight, layer.bias if layer.bias is not None else layer.weight, out,
            rows.shape[0], x.eps if normed else 0.0)
    flags = dict(N=n, K=k, ADD=add, NORM=normed, FP8=fp8, SILU=silu, BIAS=layer.bias is not None, PDL=PDL,
                 UPCAST=INTERPRETED)
    _launch(args, flags, c)
    group = getattr(layer, "group", None)
    return group.all_reduce(out) if group is not None else out


def _launch(args: tuple, flags: dict, c: FewRowsConfig) -> None:
    """Launch with tile ``c``, or the nearest that fits this GPU's shared memory (fewer stages, then shorter K
    tiles: the norm's operands are pipelined too), remembered per kernel variant."""
    key = (c, *flags.values())
    c = _FITTED.get(key, c)
    while True:
        try:
            _few_rows_kernel[(triton.cdiv(flags["N"], c.block_n),)](
                *args, **flags, BLOCK_M=16, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps,
                num_stages=c.stages, **launch_options())
            return
        except triton.runtime.errors.OutOfResources:
            if c.stages <= 2 and c.block_k <= 64:
                raise
            c = replace(c, stages=c.stages - 1) if c.stages > 2 else replace(c, block_k=c.block_k // 2)
            _FITTED[key] = c


_FITTED: dict = {}


def materialize(x) -> torch.Tensor:
    """A ``Normed`` as the tensor it stands for (the norm kernels; for a consumer without these kernels)."""
    from .triton_layers import add_rmsnorm, rmsnorm

    if not isinstance(x, Normed):
        return x
    if x.residual is None:
        return rmsnorm(x.x, x.weight, x.eps)
    out, total = add_rmsnorm(x.x, x.residual, x.weight, x.eps)
    x.total.copy_(total)
    return out


_PICKS: dict = {}


def config_for(n: int, k: int, silu: bool, fp8: bool) -> FewRowsConfig:
    """The tile for an ``[n, k]`` projection (``n``: outputs after SiLU-times-up): a sweep's pick if one was
    loaded (``PDSERVE_FEW_ROWS_CONFIGS``), else the default for its kind."""
    pick = _PICKS.get(shape_key(n, k, silu, fp8))
    if pick is not None:
        return pick
    if fp8:
        return FewRowsConfig(32 if silu else 64, 512, 4, 4)
    return FewRowsConfig(16, 512, 4, 3 if silu else 4)


def shape_key(n: int, k: int, silu: bool, fp8: bool) -> str:
    return f"{n}x{k}{'-silu' if silu else ''}{'-fp8' if fp8 else ''}"


def load_picks(path: str | None = os.environ.get("PDSERVE_FEW_ROWS_CONFIGS")) -> None:
    """Tiles picked by a sweep: ``{shape_key: {block_n, block_k, warps, stages}}``."""
    if path:
        with open(path) as f:
            _PICKS.update({key: FewRowsConfig(**c) for key, c in json.load(f).items()})


load_picks()
