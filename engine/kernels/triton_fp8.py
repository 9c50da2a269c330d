"""FP8-weight GEMM for few rows (decode at small batch) as Triton kernels (CUDA).

``_scaled_mm`` needs the activations in FP8 too, which costs a quantization
launch per projection and, at a batch of a few tokens, a cuBLAS kernel tuned
for large tiles. Reading the weights is all that matters there, so these
kernels read each FP8 weight tile once and apply each output channel's scale
at the end: ``y[t, o] = (x[t] . wq[o]) * s[o]``. Kinds (``W8Config.kind``):

* ``swap``: the weight tile is the left operand of the tensor-core product
  (``BLOCK_N`` output channels x ``BLOCK_K``), the few rows of ``x`` the right
  one ("swap AB": the small side is the MMA's narrow one), widened from FP8
  to ``x``'s dtype in registers (W8A16: activations not quantized);
* ``nt``: the same with ``x`` on the left (``BLOCK_M`` >= 16 rows padded);
* ``fma``: no tensor cores, each weight element times each row on the CUDA
  cores (a GEMV; cheapest for one or two rows);
* ``fp8dot``: ``swap`` with the activations quantized per row first
  (``triton_quant``), the product FP8 x FP8 on the tensor cores (W8A8, the
  numerics of ``_scaled_mm``).

One program per ``BLOCK_N`` output channels walks all of K. ``pdserve bench
fp8`` times every kind and tile; ``config_for`` holds what it measured best
on an H200. ``fp8_linear.Fp8Linear`` sends batches of at most ``MAX_ROWS``
rows here on CUDA."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = int(os.environ.get("PDSERVE_FP8_GEMV_ROWS", "32"))  # 0: _scaled_mm for every batch (bench A/B)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class W8Config:
    kind: str = "swap"
    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 4


@triton.jit(do_not_specialize=["M"])  # N, K specialized (multiples of 16): aligned, vectorized loads
def _w8_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, M, N, K, stride_xm, stride_om, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr, UPCAST: tl.constexpr):
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
        if UPCAST:
            xt = xt.to(tl.float32)
        if KIND == 0:  # swap
            acc += tl.dot(w.to(xt.dtype), xt)
        elif KIND == 1:  # nt: rows on the left
            acc += tl.trans(tl.dot(tl.trans(xt), tl.trans(w.to(xt.dtype))))
        elif KIND == 2:  # fma: CUDA cores, row by row
            wf = w.to(tl.float32)
            for r in tl.static_range(BLOCK_M):
                xr = tl.sum(tl.where(m[None, :] == r, xt.to(tl.float32), 0.0), axis=1)
                acc += tl.where(m[None, :] == r, tl.sum(wf * xr[None, :], axis=1)[:, None], 0.0)
        else:  # fp8dot: x already e4m3
            acc += tl.dot(w, xt)
    acc = acc * tl.load(s_ptr + n, mask=nmask, other=0.0)[:, None]
    if KIND == 3:
        acc = acc * tl.load(xs_ptr + m, mask=mmask, other=0.0)[None, :]
    tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[None, :] & nmask[:, None])


KINDS = {"swap": 0, "nt": 1, "fma": 2, "fp8dot": 3}


def config_for(rows: int, n: int, k: int) -> W8Config:
    """The kernel and tile for ``rows`` rows times an ``[n, k]`` weight: W8A8 (``fp8dot``) at every batch, so a
    sequence's numbers do not depend on how many others share its step; tiles from ``pdserve bench fp8`` on an
    H200 (Mistral-7B shapes, 1-32 rows: 1.4-2.0x faster than bf16 ``F.linear``, 1.5-2.7x than ``_scaled_mm``)."""
    if k >= 8192:  # long rows (down): deeper pipeline
        return W8Config("fp8dot", 64, 512, 4, 5)
    if n >= 16384:  # many channels (gate_up): wider tiles
        return W8Config("fp8dot", 128, 256, 4, 3)
    return W8Config("fp8dot", 64, 512, 4, 3)


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: W8Config | None = None):
    """``x`` ``[rows, K]`` (bf16/fp16) times FP8 ``weight`` ``[N, K]`` with per-row ``scale`` ``[N]`` (or
    ``[1, N]``) -> ``[rows, N]`` in ``x``'s dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    c = config or config_for(rows, n, k)
    kind = KINDS[c.kind]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    xs = scale
    if kind == 3:
        from .triton_quant import quantize_rows

        x, xs = quantize_rows(x)
    least = 1 if kind == 2 else 16
    block_m = max(least, triton.next_power_of_2(rows))
    _w8_kernel[(triton.cdiv(n, c.block_n),)](
        x, weight, scale, xs, out, rows, n, k, x.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, KIND=kind, UPCAST=INTERPRETED and kind != 3, num_warps=c.warps, num_stages=c.stages)
    return out
