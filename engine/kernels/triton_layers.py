"""RMSNorm (alone, or with the residual add before it), rotary embedding and
the MLP's SiLU-times-up as one Triton kernel each (CUDA), in place of the
several elementwise launches their torch forms take; rounded at the same points as the torch forms (``RMSNorm``, ``Rotary``,
``MLP``), so bf16 results match to the last place. Before an FP8 projection
(``quant.fp8_linear``) the RMSNorm kernel also quantizes its output rows to
e4m3 (``rmsnorm_fp8``): the numbers of ``quantize_rows`` after it, without its
launch. (SiLU-times-up does not: a whole row per program, as quantizing needs,
took 7 us on an H200 at one row against 1.5 + 1.5 for its parallel kernel and
the quantization launch; a down projection quantizing as it reads broke the
kernel's pipelining, and so did every few-row FP8 GEMM finding its rows' scales
in a first pass: batch 1 at 3.98 ms a step against 3.39 on an H100,
``fp8-ab-{gemmquant,launchquant}-h100-2026-11-26.md``. Given each row's max by its producer instead, the GEMM that
quantizes as it loads is no faster than the launch before it, which costs ~1 us under PDL: at one row on an H100
o 11.3 against 9.3 us, down 24.1 against 24.8, q/k/v and gate/up within 0.3.) Each launches with programmatic dependent launch where the GPU has it (``triton_pdl``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import ENABLED as PDL, launch_options, wait_then_release


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    n = tl.arange(0, BLOCK)
    mask = n < N
    x = tl.load(x_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * scale).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + n, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    _rmsnorm_kernel[(x.numel() // n,)](x, weight, out, eps, N=n, BLOCK=triton.next_power_of_2(n), PDL=PDL,
                                       num_warps=8 if n >= 2048 else 4, **launch_options())
    return out


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    n = tl.arange(0, BLOCK)
    mask = n < N
    dt = out_ptr.dtype.element_ty
    total = (tl.load(x_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
             + tl.load(r_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)).to(dt)
    tl.store(sum_ptr + row * N + n, total, mask=mask)
    x = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * scale).to(dt).to(tl.float32)
    w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + n, (w * y).to(dt), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rmsnorm(x + residual), x + residual)``, the sum rounded to ``x``'s dtype first (as torch adds)."""
    x, residual = x.contiguous(), residual.contiguous()
    n = x.shape[-1]
    out, total = torch.empty_like(x), torch.empty_like(x)
    _add_rmsnorm_kernel[(x.numel() // n,)](x, residual, weight, out, total, eps, N=n,
                                           BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4,
                                           PDL=PDL, **launch_options())
    return out, total


@triton.jit
def rotate(x_ptr, base, cos_ptr, sin_ptr, token, d, mask, HALF: tl.constexpr, dt: tl.constexpr):
    """The two rotated halves of the head at ``x_ptr + base`` (rounded as ``Rotary``'s torch form)."""
    x1 = tl.load(x_ptr + base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token * 2 * HALF + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + token * 2 * HALF + HALF + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + token * 2 * HALF + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + token * 2 * HALF + HALF + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    r1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    r2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return r1, r2


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, heads, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """A token's heads (``BLOCK_H`` of them) a program: under the interpreter a program per head made the tiny
    engine tests' prompts thousands of programs."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    mask = (d < HALF) & (head < heads)
    base = (token * heads + head) * 2 * HALF
    r1, r2 = rotate(x_ptr, base, cos_ptr, sin_ptr, token, d, mask, HALF, out_ptr.dtype.element_ty)
    tl.store(out_ptr + base + d, r1, mask=mask)
    tl.store(out_ptr + base + HALF + d, r2, mask=mask)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``q``/``k`` ``[tokens, heads, dim]``, ``cos``/``sin`` ``[tokens, dim]`` (fp32) -> rotated copies."""
    cos, sin = cos.contiguous(), sin.contiguous()
    out = []
    for x in (q.contiguous(), k.contiguous()):
        y = torch.empty_like(x)
        half, heads = x.shape[-1] // 2, x.shape[1]
        block_h = min(triton.next_power_of_2(heads), 8)
        _rotary_kernel[(x.shape[0], triton.cdiv(heads, block_h))](x, y, cos, sin, heads, HALF=half,
                                                                  BLOCK=triton.next_power_of_2(half), BLOCK_H=block_h)
        out.append(y)
    return out[0], out[1]


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * N + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + col, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * N + col, (act * up).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` ``[tokens, 2 * n]`` (gate then up) -> ``silu(gate) * up`` ``[tokens, n]``."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, N=n, BLOCK=block, PDL=PDL, **launch_options())
    return out


@triton.jit
def _rmsnorm_fp8_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                        ADD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    n = tl.arange(0, BLOCK)
    mask = n < N
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        total = (x + tl.load(r_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * N + n, total, mask=mask)
        x = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * scale).to(dt).to(tl.float32)
    w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
    _store_fp8_row(q_ptr + row * N, s_ptr + row, (w * y).to(dt).to(tl.float32), n, mask)


@triton.jit
def _store_fp8_row(q_ptr, s_ptr, out, n, mask):
    """A whole row (rounded to the model's dtype) as e4m3 with its scale, as ``fp8_linear.quantize_rows``."""
    s = tl.maximum(tl.max(tl.abs(out), axis=0) / 448.0, 1e-12)
    tl.store(q_ptr + n, tl.minimum(tl.maximum(out / s, -448.0), 448.0).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr, s)


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rmsnorm(x [+ residual])`` quantized per row for an FP8 projection: ``Quantized`` (plus the sum, with
    ``residual``); the numbers of ``add_rmsnorm`` then ``quantize_rows``, in one launch."""
    from ..quant.fp8_linear import Quantized
    from ..quant.kv_fp8 import FP8

    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    q = torch.empty(*x.shape, dtype=FP8, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    _rmsnorm_fp8_kernel[(rows,)](x, residual.contiguous() if residual is not None else x, weight, q, s, total, eps,
                                 N=n, BLOCK=triton.next_power_of_2(n), ADD=residual is not None,
                                 num_warps=8 if n >= 2048 else 4, PDL=PDL, **launch_options())
    out = Quantized(q, s, x.dtype)
    return (out, total) if residual is not None else out
