"""FP8-weight GEMM for few rows (decode at small batch) as a Triton kernel (CUDA).

``_scaled_mm`` at a batch of a few tokens runs a cuBLAS kernel tuned for
large tiles, well below the bandwidth that reading the weights allows. Here
one program per ``BLOCK_N`` output channels walks all of K, the FP8 weight
tile as the left operand of an FP8 x FP8 tensor-core product and the few
rows of the already quantized activations as the narrow right one ("swap
AB": ``BLOCK_M`` >= 16 rows, padded), then applies both scales:
``y[t, o] = (xq[t] . wq[o]) * s_x[t] * s_w[o]`` -- the numbers of
``_scaled_mm`` (W8A8, per-token and per-channel scales). The activations come
quantized from the kernel before (``triton_layers``: the RMSNorms write e4m3
rows and their scales) or are quantized here in one more launch
(``triton_quant``). ``pdserve bench fp8`` times the tiles; ``config_for``
holds what it measured best on an H200. ``fp8_linear.Fp8Linear`` sends
batches of at most ``MAX_ROWS`` rows here on CUDA."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_pdl import ENABLED as PDL, launch_options, wait_then_release

MAX_ROWS = int(os.environ.get("PDSERVE_FP8_GEMV_ROWS", "64"))  # 0: _scaled_mm for every batch (bench A/B)


@dataclass(frozen=True)
class W8Config:
    block_n: int = 64
    block_k: int = 512
    warps: int = 4
    stages: int = 3


@triton.jit(do_not_specialize=["M"])  # N, K specialized (multiples of 16): aligned, vectorized loads
def _w8_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, M, N, K, stride_xm, stride_om, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    nmask = n < N
    mmask = m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # transposed: output channels down, rows across
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        xt = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies no FP8
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    acc = acc * tl.load(s_ptr + n, mask=nmask, other=0.0)[:, None]
    acc = acc * tl.load(xs_ptr + m, mask=mmask, other=0.0)[None, :]
    tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[None, :] & nmask[:, None])


def config_for(rows: int, n: int, k: int) -> W8Config:
    """The tile for ``rows`` rows times an ``[n, k]`` weight (``pdserve bench fp8``, H200, Mistral-7B shapes: 1.3-2x
    faster than bf16 ``F.linear`` at 1-64 rows, 1.4-2.5x than ``_scaled_mm``; up to 16 rows from ``pdserve bench
    kernels --only w8``, whose weights come from memory, not L2: ``bench/results/kernels-w8-h200.md``)."""
    long_rows, wide = k >= 8192, n >= 16384  # down; gate_up
    if rows <= 16:
        if long_rows or wide:
            return W8Config(64, 512, 4, 5) if long_rows else W8Config(64, 256, 4, 4)
        return W8Config(64, 256, 4, 5) if n > k else W8Config(64, 512, 4, 4)  # q/k/v; o
    if rows <= 32:  # the activations' tiles grow with the rows: shorter K tiles keep the stages in shared memory
        return W8Config(64, 256, 4, 5) if long_rows else W8Config(64, 128, 4, 3) if wide else W8Config(64, 256)
    return W8Config(64, 128, 4, 3) if wide else W8Config()


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: W8Config | None = None,
              x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[rows, K]`` times FP8 ``weight`` ``[N, K]`` with per-channel ``scale`` (``[N]`` or ``[1, N]``) ->
    ``[rows, N]`` in ``out_dtype`` (default ``x``'s, bf16 for FP8 ``x``): ``x`` in bf16/fp16 is quantized per row
    here; e4m3 ``x`` comes with its ``x_scale`` ``[rows, 1]``."""
    dtype = out_dtype or (torch.bfloat16 if x_scale is not None else x.dtype)
    if x_scale is None:
        from .triton_quant import quantize_rows

        x, x_scale = quantize_rows(x)
    rows, k = x.shape
    n = weight.shape[0]
    c = config or config_for(rows, n, k)
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(rows))
    key = (c, block_m)
    c = _SMALLER.get(key, c)
    try:
        _launch(x, weight, scale, x_scale, out, rows, n, k, block_m, c)
    except triton.runtime.errors.OutOfResources:  # a GPU with less shared memory (Ada: 100 KB): shorter tiles
        _SMALLER[key] = c = W8Config(c.block_n, 128, c.warps, 2)
        _launch(x, weight, scale, x_scale, out, rows, n, k, block_m, c)
    return out


_SMALLER: dict = {}


def _launch(x, weight, scale, x_scale, out, rows, n, k, block_m, c) -> None:
    _w8_kernel[(triton.cdiv(n, c.block_n),)](
        x, weight, scale, x_scale, out, rows, n, k, x.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, UPCAST=os.environ.get("TRITON_INTERPRET") == "1", PDL=PDL, num_warps=c.warps,
        num_stages=c.stages, **launch_options())
