"""GEMM for a few rows (decode at batch 1-64) as a Triton kernel, FP8 or bf16/fp16 weights, split along K (CUDA).

At a batch of a few tokens a projection reads its weight once and does
little arithmetic with it: its time is the weight's bytes over the bandwidth
the kernel can draw. cuBLAS picks tiles made for many rows, and a tile per
output block leaves most SMs idle on a narrow projection (o and down have
4,096 output channels: 64 programs of 64 on 132 SMs). Here:

* "swap AB": one program owns ``BLOCK_N`` output channels; the weight tile is
  the left operand of a tensor-core product (``BLOCK_N`` >= 64 fills an
  H100/H200 warpgroup MMA) and the few rows the narrow right one
  (``BLOCK_M`` >= 16, padded);
* split-K: ``SPLIT_K`` programs share an output block, each walking its own
  ``1/SPLIT_K`` of K, so a narrow projection runs ``SPLIT_K`` times as many
  programs. Each writes its fp32 partial sums to a workspace and takes a
  ticket (an atomic add on the block's counter, after a barrier: the
  partials are written before it). The program that takes the last ticket
  adds the partials in split order (the sums do not depend on which program
  finishes last), writes the output and puts the counter back to zero for the
  next launch: one launch, no memset. Counters live in one zeroed buffer per
  device made outside graph capture (``counters``); a launch under capture
  with none made yet runs unsplit;
* FP8 (``SCALED``): e4m3 weights with per-channel scales times e4m3 rows with
  per-row scales, ``y[t, o] = (xq[t] . wq[o]) * s_x[t] * s_w[o]``: the numbers
  of ``_scaled_mm`` (W8A8). Else the rows and weights in bf16/fp16, fp32 sums;
* ``BIAS``; programmatic dependent launch (``triton_pdl``), the next kernel let
  go at the start and the first weight tile loaded before the wait for the
  rows (weights depend on no kernel before): at a few rows a projection is a
  few microseconds, and its first bytes' latency was a good part of them;
* ``PREP`` / ``ROW_SCALE``: the two halves of an RMSNorm split around two
  projections (``NormPart``; ``triton_fewrow_norm`` says how).

``triton_fp8.w8_matmul`` runs FP8 projections here; ``linear`` runs a
bf16/fp16 ``nn.Linear`` (``takes``: rows and shapes where ``config_for`` holds
a tile measured faster than cuBLAS; fp32 ones with IEEE products, for tests).
``pdserve bench kernels --only fewrow`` times tiles with the weights read from
memory."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import shipped_picks
from .tiles import smaller
from .triton_pdl import ENABLED as PDL, launch_options

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 64  # bf16 batches up to this many rows
NORM_ROWS = 32  # the norms split around it up to these
COUNTERS = 1 << 14  # output blocks a launch may split (28,672 outputs / 16 = 1,792), and one more slot:
GRID_SLOT = COUNTERS - 1  # a launch's own ticket (the last program of a norm's consumer zeroes the squares)
_GRID_SLOT = tl.constexpr(GRID_SLOT)


@dataclass(frozen=True)
class FewRowConfig:
    block_n: int = 64
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    split_k: int = 1


@triton.jit(do_not_specialize=["M", "eps"])  # N, K specialized (multiples of 16): aligned, vectorized loads
def _few_row_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, out_ptr, part_ptr, count_ptr, r_ptr, g_ptr, sum_ptr, sq_ptr,
                    eps, M, N, K, stride_xm, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALED: tl.constexpr, BIAS: tl.constexpr,
                    PREP: tl.constexpr, ROW_SCALE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel may start now: it fetches its first weights while this one runs
        tl.extra.cuda.gdc_launch_dependents()
    block = tl.program_id(0)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    chunks = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # BLOCK_K chunks per split
    k_lo = tl.program_id(1) * chunks * BLOCK_K
    k_hi = tl.minimum(K, k_lo + chunks * BLOCK_K)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    k = k_lo + tl.arange(0, BLOCK_K)  # the first tile, peeled: its weights depend on nothing before, so with
    w = tl.load(rows + k[None, :], mask=nmask[:, None] & (k < k_hi)[None, :], other=0.0)  # they are on their
    if PDL:  # way while the kernel before ends; then its output (the rows) may be read
        tl.extra.cuda.gdc_wait()
    acc = _tile(w, x_ptr, m, mmask, k, k < k_hi, stride_xm, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # acc: transposed, output channels down, rows across
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc = _tile(w, x_ptr, m, mmask, k, kmask, stride_xm, acc, UPCAST)
    out_at = out_ptr + m[None, :] * stride_om + n[:, None]
    mask = mmask[None, :] & nmask[:, None]
    norm = (r_ptr, g_ptr, sum_ptr, sq_ptr, eps, K, stride_om)
    if SPLIT_K == 1:
        _finish(acc, out_at, mask, s_ptr, xs_ptr, b_ptr, n, m, nmask, mmask, norm, SCALED, BIAS, PREP, ROW_SCALE)
        if ROW_SCALE:  # the last program to have read the squares zeroes them for the next norm's
            tl.debug_barrier()
            ticket = tl.atomic_add(count_ptr + _GRID_SLOT, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.num_programs(0) - 1:
                tl.store(sq_ptr + m, tl.zeros([BLOCK_M], tl.float32), mask=mmask)
                tl.atomic_xchg(count_ptr + _GRID_SLOT, 0, sem="relaxed", scope="gpu")
    else:
        part = part_ptr + m[None, :] * N + n[:, None]  # [SPLIT_K, M, N] fp32
        tl.store(part + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials written before the ticket is taken
        ticket = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last of the block: the others' partials are visible (acquire)
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(total, out_at, mask, s_ptr, xs_ptr, b_ptr, n, m, nmask, mmask, norm, SCALED, BIAS, PREP,
                    ROW_SCALE)
            tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _tile(w, x_ptr, m, mmask, k, kmask, stride_xm, acc, UPCAST: tl.constexpr):
    """``acc`` plus the weight tile ``w`` times the rows' columns ``k``."""
    xt = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
    if UPCAST:  # the interpreter multiplies no FP8 (nor bf16 right)
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32))
    if w.dtype == tl.float32:  # fp32 weights (tiny test models): no TF32 rounding
        return acc + tl.dot(w, xt, input_precision="ieee")
    return acc + tl.dot(w, xt)


@triton.jit
def _finish(acc, out_at, mask, s_ptr, xs_ptr, b_ptr, n, m, nmask, mmask, norm, SCALED: tl.constexpr,
            BIAS: tl.constexpr, PREP: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The output block: scales, the RMS scale of a prepared norm (``ROW_SCALE``), bias; or (``PREP``) the sum
    with the residual, that sum times the norm's weight and the sum's squares added up per row."""
    r_ptr, g_ptr, sum_ptr, sq_ptr, eps, K, stride = norm
    dt = out_at.dtype.element_ty
    if SCALED:
        acc = acc * tl.load(s_ptr + n, mask=nmask, other=0.0)[:, None]
        acc = acc * tl.load(xs_ptr + m, mask=mmask, other=0.0)[None, :]
    if ROW_SCALE:  # rows came as sum * weight: 1 / RMS(sum) applies to the products' sums
        acc = acc * tl.rsqrt(tl.load(sq_ptr + m, mask=mmask, other=0.0) / K + eps)[None, :]
    if BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    if PREP:  # rounded as the GEMM's output, then as the sum with the residual (``add_rmsnorm``)
        at = m[None, :] * stride + n[:, None]
        total = (acc.to(dt).to(tl.float32) + tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + at, total, mask=mask)
        total = total.to(tl.float32)
        acc = total * tl.load(g_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.atomic_add(sq_ptr + m, tl.sum(total * total, axis=0), mask=mmask, sem="relaxed", scope="gpu")
    tl.store(out_at, acc.to(dt), mask=mask)


class NormPart(NamedTuple):
    """An RMSNorm split around the kernel: ``prep`` (on the projection before the norm): write ``total`` = output +
    ``residual``, output ``total * weight`` and add the squares of ``total`` per row into ``squares``; else (on the
    projection after it): the rows are ``total * weight``, scale by 1 / RMS from ``squares``, then zero those."""
    prep: bool
    squares: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    total: torch.Tensor | None = None


def matmul(x: torch.Tensor, weight: torch.Tensor, config: FewRowConfig, out: torch.Tensor,
           scales: tuple[torch.Tensor, torch.Tensor] | None = None, bias: torch.Tensor | None = None,
           norm: NormPart | None = None) -> None:
    """``out`` ``[rows, N]`` = ``x`` ``[rows, K]`` times ``weight`` ``[N, K]`` (+ ``bias``); FP8 operands with
    ``scales`` = (the weight's per-channel ``[N]``/``[1, N]``, the rows' ``[rows, 1]``); ``norm``: a part of the
    RMSNorm between two projections (``out``, ``residual`` and ``total`` contiguous)."""
    rows, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    c = _FITTED.get((config, block_m), config)
    c = replace(c, split_k=min(c.split_k, triton.cdiv(k, c.block_k)))  # every split at least one chunk
    if norm is not None and not norm.prep:
        c = replace(c, split_k=1)  # the RMS scale applies once, to whole sums
    count = counters(x.device) if c.split_k > 1 or norm is not None else None
    if count is None or triton.cdiv(n, c.block_n) >= GRID_SLOT:
        c = replace(c, split_k=1)
    if norm is not None and count is None:
        raise RuntimeError("a norm split around the kernel needs the counters made before graph capture")
    part = torch.empty(c.split_k, rows, n, dtype=torch.float32, device=x.device) if c.split_k > 1 else out
    s, xs = scales if scales is not None else (weight, weight)
    prep = norm is not None and norm.prep
    norm_args = (norm.residual if prep else x, norm.weight if prep else x, norm.total if prep else x,
                 norm.squares, norm.eps) if norm is not None else (x, x, x, x, 0.0)
    args = (x, weight, s, xs, bias if bias is not None else weight, out, part, count if count is not None else out,
            *norm_args, rows, n, k, x.stride(0), out.stride(0))
    flags = dict(BLOCK_M=block_m, SCALED=scales is not None, BIAS=bias is not None, PREP=prep,
                 ROW_SCALE=norm is not None and not prep, UPCAST=INTERPRETED, PDL=PDL)
    while True:
        try:
            _few_row_kernel[(triton.cdiv(n, c.block_n), c.split_k)](
                *args, **flags, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k, num_warps=c.warps,
                num_stages=c.stages, **launch_options())
            return
        except triton.runtime.errors.OutOfResources:  # less shared memory (Ada: 100 KB): fewer stages, shorter K
            c = smaller(c)
            if c is None:
                raise
            _FITTED[(config, block_m)] = c


_FITTED: dict = {}
_COUNTERS: dict = {}


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed split-K counters (each launch leaves them zero), made on first use outside capture."""
    have = _COUNTERS.get(device)
    if have is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        have = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        _SQUARES[device] = torch.zeros(max(MAX_ROWS, 1), dtype=torch.float32, device=device)
    return have


_SQUARES: dict = {}  # per device: the rows' sums of squares between a norm's two parts (zero between norms)


def takes(x, layer) -> bool:
    """Whether ``linear`` runs ``layer`` on ``x``: a 2-D CUDA (or interpreter) tensor of at most ``MAX_ROWS`` rows in
    the weight's bf16/fp16, at a shape ``config_for`` has a tile for."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not (x.is_cuda or INTERPRETED):
        return False
    w = layer.weight
    return x.dtype == w.dtype and w.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        and 1 <= x.shape[0] <= MAX_ROWS and config_for(x.shape[0], *w.shape, kind_of(w.dtype)) is not None


def kind_of(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"  # fp16 takes bf16's tiles


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``layer(x)`` for an ``nn.Linear`` (a row-parallel shard all-reduces after), on the few-row kernel."""
    if x.stride(1) != 1:
        x = x.contiguous()
    n, k = layer.weight.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    matmul(x, layer.weight, config_for(x.shape[0], n, k, kind_of(x.dtype)), out, bias=layer.bias)
    group = getattr(layer, "group", None)
    return group.all_reduce(out) if group is not None else out


_PICKS: dict = {}
def pick(kind: str, rows: int, n: int, k: int):
    """A sweep's tile for ``kind`` (``bf16`` or ``fp8`` weights) at ``rows`` rows, ``None`` where it found cuBLAS
    faster, or ``...`` where it measured nothing."""
    shipped_picks.load_once("fewrow", "PDSERVE_FEWROW_CONFIGS", load_picks)  # a file named there replaces them
    return _PICKS.get(pick_key(kind, rows, n, k), ...)


def pick_key(kind: str, rows: int, n: int, k: int) -> str:
    return f"{kind}-{max(16, triton.next_power_of_2(rows))}x{n}x{k}"


def config_for(rows: int, n: int, k: int, kind: str = "bf16") -> FewRowConfig | None:
    """The tile for ``rows`` rows times a ``kind`` (bf16 or fp16; fp32) ``[n, k]`` weight, or None where cuBLAS was
    measured faster or nothing was measured (a sweep's picks if loaded: ``PDSERVE_FEWROW_CONFIGS``)."""
    chosen = pick(kind, rows, n, k)
    if chosen is not ...:
        return chosen
    if INTERPRETED:
        return FewRowConfig(32, 64, 4, 2, 2)
    return _measured(rows, n, k) if kind == "bf16" else None


def _measured(rows: int, n: int, k: int) -> FewRowConfig | None:
    """What the H200 sweep of the Mistral-7B shapes found faster than cuBLAS (by 2-17%, weights from memory:
    ``bench/results/kernels-fewrow-h200.md``): down (K in two halves) at up to 64 rows, q/k/v and o at up to 32;
    cuBLAS for gate/up (it reads that one at 90%) and for q/k/v and o at 64 rows."""
    if rows > 64 or n >= 4 * k:
        return None
    if k > n:
        return FewRowConfig(64, 256 if rows <= 32 else 128, 4, 4, 2)
    if rows > 32:
        return None
    return FewRowConfig(64, 128, 4, 4) if n > k else FewRowConfig(64, 256, 4, 4)


def load_picks(path: str | None = os.environ.get("PDSERVE_FEWROW_CONFIGS")) -> None:
    """Tiles picked by a sweep (``pdserve bench kernels --only fewrow``): ``{pick_key: {block_n, block_k, warps,
    stages, split_k} or null}``."""
    if path:
        import json

        with open(path) as f:
            _PICKS.update({key: FewRowConfig(**c) if c else None for key, c in json.load(f).items()})


load_picks()
