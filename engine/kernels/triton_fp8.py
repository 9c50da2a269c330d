"""FP8-weight GEMM for few rows (decode at small batch) as one Triton kernel (CUDA).

``_scaled_mm`` needs the activations in FP8 too, which costs a quantization
launch per projection and, at a batch of a few tokens, a cuBLAS kernel tuned
for large tiles. Reading the weights is all that matters there, so this
kernel reads each FP8 weight tile once, widens it to the activations' dtype
in registers and multiplies on the tensor cores (W8A16: activations are not
quantized), then applies each output channel's scale: ``y = (x . wq[o]) *
s[o]``. One program per ``BLOCK_N`` output channels walks all of K (no
split-K: no second pass); ``BLOCK_M`` rows at once (16, the tensor cores'
least). ``fp8_linear.Fp8Linear`` sends batches of at most ``MAX_ROWS`` rows
here on CUDA."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ROWS = int(os.environ.get("PDSERVE_FP8_GEMV_ROWS", "16"))  # 0: _scaled_mm for every batch (bench A/B)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _w8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, stride_xm, stride_om, N: tl.constexpr, K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    nmask = n < N
    mmask = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    s = tl.load(s_ptr + n, mask=nmask, other=0.0)
    acc = acc * s[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int = 16, block_k: int = 512,
              warps: int = 4, stages: int = 4) -> torch.Tensor:
    """``x`` ``[rows <= MAX_ROWS, K]`` (bf16/fp16) times FP8 ``weight`` ``[N, K]`` with per-row ``scale``
    ``[N]`` (or ``[1, N]``) -> ``[rows, N]`` in ``x``'s dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(rows))
    _w8_kernel[(triton.cdiv(n, block_n),)](x, weight, scale, out, rows, x.stride(0), out.stride(0), N=n, K=k,
                                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                           UPCAST=INTERPRETED or x.dtype == torch.float32, num_warps=warps,
                                           num_stages=stages)
    return out
