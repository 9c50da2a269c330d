"""Decode projections of one row (batch 1) with their neighbours fused, as one Triton GEMV kernel (CUDA).

At batch 1 a decode step reads every weight once; what it spends beyond
that is launches and the bandwidth its GEMMs leave unused. Between two
GEMVs of a layer sat a norm (with the residual add), SiLU-times-up or, with
FP8 weights, the activations' quantization, each about 2 us however small,
and cuBLAS read the narrow projections (q/k/v, o) at 75-78% of the
bandwidth. Here one program owns ``BLOCK_N`` output channels and walks all
of K: the weight tile times the row, products summed in fp32 on the CUDA
cores (a tensor-core product would pad the row to 16), each weight tile
loaded one step ahead of its use, or two (``GemvConfig.ahead``: twice the
bytes in flight, for projections too narrow to fill the SMs otherwise; the
first tiles before the kernel waits for its input: weights depend on
nothing before), with:

* prologue ``NORM``: the row is ``rmsnorm(x [+ residual])`` computed as it
  is read (a first pass over the row, from L2, finds its scale; program 0
  also writes the sum for the residual stream): an RMSNorm hands ``Normed``
  to the projection instead of launching (``defer``);
* prologue ``FP8`` (e4m3 weights with per-channel scales): the row is
  quantized as it is read (another pass finds max|x|): the numbers of
  ``quantize_rows`` + ``_scaled_mm`` (W8A8), without their launch;
* epilogue ``SILU``: the program reads gate rows ``n`` and up rows ``N + n``
  and writes ``silu(gate) * up``: the MLP is two launches;
* epilogue ``PUSH`` (a row-parallel projection under TP, ``engine.parallel.pushed``): the program's channels go
  straight into every rank's slot over NVLink, and a small pull kernel sums them: the all-reduce after the
  projection without its copy and barriers;
* programmatic dependent launch (``triton_pdl``, Hopper+), as the
  attention kernels between the projections: the gaps between launches are
  hidden.

Every value is rounded where the torch forms round (``RMSNorm``, ``MLP``,
``Fp8Linear``); only the order of the sums differs from cuBLAS. Batches of
more rows keep the separate launches (cuBLAS, or ``triton_fp8``'s few-row
FP8 GEMM). Tiles: ``config_for`` (``pdserve bench kernels --only fused
--sweep`` measures them; ``PDSERVE_GEMV_CONFIGS`` names a JSON of its picks
to use)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import shipped_picks
from .tiles import smaller
from .triton_pdl import ENABLED as PDL, launch_options
from .triton_pushed import push_words

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
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    ahead: int = 1  # weight tiles a program has in flight beyond the one it multiplies (1 or 2)


def takes(x) -> bool:
    """Whether the kernel runs ``x``: a deferred norm, or one row of a 2-D CUDA tensor (the interpreter's CPU
    tensors in tests)."""
    if isinstance(x, Normed):
        return True
    if not isinstance(x, torch.Tensor):  # ``Quantized`` rows (more than one, before an FP8 projection)
        return False
    return (x.is_cuda or INTERPRETED) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        and x.dim() == 2 and x.shape[0] == 1


def defer(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """What ``RMSNorm.forward`` returns for one row: ``Normed`` (with ``residual``: and the sum's tensor)."""
    x = x.contiguous()
    if residual is None:
        return Normed(x, None, weight, eps, None)
    total = torch.empty_like(x)
    return Normed(x, residual.contiguous(), weight, eps, total), total


@triton.jit
def _row(x_ptr, r_ptr, nw_ptr, k, kmask, rs, xs, ADD: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr,
         dt: tl.constexpr):
    """The row's inputs at columns ``k`` in fp32: ``x`` (+ residual, rounded), normed (rounded as ``RMSNorm``),
    divided by the row's FP8 scale and saturated."""
    v = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
    if ADD:
        v = (v + tl.load(r_ptr + k, mask=kmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if NORM:
        v = (v * rs).to(dt).to(tl.float32)
        v = (tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32) * v).to(dt).to(tl.float32)
    if QUANT:
        v = tl.minimum(tl.maximum(v / xs, -448.0), 448.0)
    return v


@triton.jit(do_not_specialize=["eps"])
def _one_row_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, eps,
                    push_ptr, step_ptr, site,
                    N: tl.constexpr, K: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                    SILU: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr,
                    PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, CAP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:  # the next kernel may start (and fetch its first weights) once every program here has
        tl.extra.cuda.gdc_launch_dependents()
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    rows = w_ptr + n[:, None].to(tl.int64) * K
    w_next = tl.load(rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)  # weights depend on
    if SILU:  # nothing before: the first tiles are on their way while the kernel before ends and the row is normed
        u_next = tl.load(rows + N * K + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)
    if AHEAD == 2:  # a second tile in flight: twice the bytes an SM waits on (narrow projections leave SMs idle)
        second = nmask[:, None] & (kk + BLOCK_K < K)[None, :]
        w_next2 = tl.load(rows + (kk + BLOCK_K)[None, :], mask=second, other=0.0)
        if SILU:
            u_next2 = tl.load(rows + N * K + (kk + BLOCK_K)[None, :], mask=second, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the row is the kernel before's output
    rs = 1.0
    xs = 1.0
    if NORM:  # the row's RMS scale; program 0 writes the residual sum on the way
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            v = _row(x_ptr, r_ptr, nw_ptr, k, k < K, rs, xs, ADD, False, False, dt)
            if ADD:
                if pid == 0:
                    tl.store(sum_ptr + k, v.to(dt), mask=k < K)
            ss += v * v
        rs = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if FP8:  # the row's e4m3 scale: max|row| / 448
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            amax = tl.maximum(amax, tl.abs(_row(x_ptr, r_ptr, nw_ptr, k, k < K, rs, xs, ADD, NORM, False, dt)))
        xs = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # products summed along K once, after the loop
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # each tile loaded AHEAD steps ahead of its use
        k = k0 + kk
        w = w_next
        if SILU:
            u = u_next
        if AHEAD == 2:
            ahead = nmask[:, None] & (k + 2 * BLOCK_K < K)[None, :]
            w_next = w_next2
            w_next2 = tl.load(rows + (k + 2 * BLOCK_K)[None, :], mask=ahead, other=0.0)
            if SILU:
                u_next = u_next2
                u_next2 = tl.load(rows + N * K + (k + 2 * BLOCK_K)[None, :], mask=ahead, other=0.0)
        else:
            ahead = nmask[:, None] & (k + BLOCK_K < K)[None, :]
            w_next = tl.load(rows + (k + BLOCK_K)[None, :], mask=ahead, other=0.0)
            if SILU:
                u_next = tl.load(rows + N * K + (k + BLOCK_K)[None, :], mask=ahead, other=0.0)
        v = _row(x_ptr, r_ptr, nw_ptr, k, k < K, rs, xs, ADD, NORM, FP8, dt).to(w_ptr.dtype.element_ty)
        v = v.to(tl.float32)[None, :]  # FP8: the e4m3 value, exactly
        acc += w.to(tl.float32) * v
        if SILU:
            acc_up += u.to(tl.float32) * v
    y = tl.sum(acc, axis=1)
    if FP8:
        y = y * tl.load(ws_ptr + n, mask=nmask, other=0.0) * xs
    y = y.to(dt).to(tl.float32)
    if BIAS:
        y = (y + tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if SILU:  # rounded as the gate/up GEMM's output, then as ``triton_layers.silu_mul``
        up = tl.sum(acc_up, axis=1)
        if FP8:
            up = up * tl.load(ws_ptr + N + n, mask=nmask, other=0.0) * xs
        up = up.to(dt).to(tl.float32)
        if BIAS:
            up = (up + tl.load(b_ptr + N + n, mask=nmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32) * up
    if PUSH:  # a row-parallel projection: its share straight into every rank's slot (``parallel.pushed``)
        push_words(y, push_ptr, step_ptr, site, n, nmask, RANK, WORLD, CAP)
    else:
        tl.store(out_ptr + n, y.to(dt), mask=nmask)


def linear(x, layer, silu: bool = False, config: GemvConfig | None = None) -> torch.Tensor:
    """``layer(x)`` for one row (``x``: a tensor ``[1, K]`` or ``Normed``); ``layer``: an ``nn.Linear``
    (a row-parallel one all-reduces after) or an ``Fp8Linear``. ``silu``: ``layer`` is the fused gate/up
    projection and the result is ``silu(gate) * up``."""
    normed = isinstance(x, Normed)
    rows = x.x if normed else x.contiguous()
    dtype = rows.dtype
    fp8 = layer.weight.dtype == FP8
    n_total, k = layer.weight.shape
    n = n_total // 2 if silu else n_total
    group = getattr(layer, "group", None)
    slots = getattr(group, "pushed", None)
    push = slots is not None and slots.takes(rows.shape[0], n, dtype)
    out = torch.empty(rows.shape[0], n, dtype=dtype, device=rows.device)
    add = normed and x.residual is not None
    c = config or config_for(n, k, silu, fp8)
    args = (rows, x.residual if add else rows, x.weight if normed else rows, x.total if add else out, layer.weight,
            layer.weight_scale if fp8 else layer.weight, layer.bias if layer.bias is not None else layer.weight, out,
            x.eps if normed else 0.0)
    site = slots.site() if push else 0
    args += (slots.buffers, slots.step, site) if push else (out, out, 0)
    ranks = dict(RANK=slots.rank, WORLD=slots.world, CAP=slots.cap) if push else dict(RANK=0, WORLD=1, CAP=1)
    flags = dict(N=n, K=k, ADD=add, NORM=normed, FP8=fp8, SILU=silu, BIAS=layer.bias is not None, PDL=PDL,
                 PUSH=push, **ranks)
    _launch(args, flags, c)
    if push:  # the row-parallel sum: every rank's share is in (or on its way to) this rank's slot
        return slots.pull(site, out)
    return out if group is None else group.all_reduce(out)


def _launch(args: tuple, flags: dict, c: GemvConfig) -> None:
    """Launch with tile ``c``, or the nearest that fits this GPU's shared memory (fewer stages, then shorter K
    tiles: the norm's operands are pipelined too), remembered per kernel variant."""
    key = (c, *flags.values())
    c = _FITTED.get(key, c)
    while True:
        try:
            _one_row_kernel[(triton.cdiv(flags["N"], c.block_n),)](
                *args, **flags, BLOCK_N=c.block_n, BLOCK_K=c.block_k, AHEAD=c.ahead, num_warps=c.warps,
                num_stages=c.stages, **launch_options())
            return
        except triton.runtime.errors.OutOfResources:
            c = smaller(c)
            if c is None:
                raise
            _FITTED[key] = c


_FITTED: dict = {}


_PICKS: dict = {}
def config_for(n: int, k: int, silu: bool, fp8: bool) -> GemvConfig:
    """The tile for an ``[n, k]`` projection (``n``: outputs after SiLU-times-up): a sweep's pick if one was
    loaded (``PDSERVE_GEMV_CONFIGS``, else the picks shipped for this GPU: ``shipped_picks``), else by kind, as the
    H200 sweep of the Mistral-7B shapes picked them."""
    shipped_picks.load_once("gemv", "PDSERVE_GEMV_CONFIGS", load_picks)  # a file named there replaces them
    pick = _PICKS.get(shape_key(n, k, silu, fp8))
    if pick is not None:
        return pick
    if silu:  # gate/up: two accumulators
        return GemvConfig(8, 256, 4, 3)
    if fp8 and n <= k:  # o, down
        return GemvConfig(16, 512, 8, 3)
    if n <= k:
        return GemvConfig(8, 512, 8, 3) if k > 2 * n else GemvConfig(4, 512, 4, 3)  # down; o
    return GemvConfig(16 if fp8 else 8, 256, 4, 3)  # q/k/v


def shape_key(n: int, k: int, silu: bool, fp8: bool) -> str:
    return f"{n}x{k}{'-silu' if silu else ''}{'-fp8' if fp8 else ''}"


def load_picks(path: str | None = os.environ.get("PDSERVE_GEMV_CONFIGS")) -> None:
    """Tiles picked by a sweep: ``{shape_key: {block_n, block_k, warps, stages}}``."""
    if path:
        with open(path) as f:
            _PICKS.update({key: GemvConfig(**c) for key, c in json.load(f).items()})


load_picks()
