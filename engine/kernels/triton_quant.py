"""Per-row FP8 quantization of activations (``quant.fp8_linear``) as one Triton kernel (CUDA): each program reads
a row once, finds its max|x|, and writes the e4m3 row and its fp32 scale (``max|x| / 448``), as
``fp8_linear.quantize_rows`` does in torch (five launches there)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8_linear import MIN_SCALE
from ..quant.kv_fp8 import FP8, FP8_MAX
from .triton_pdl import ENABLED as PDL, launch_options, wait_then_release


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, N: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                          LOW: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    n = tl.arange(0, BLOCK)
    mask = n < N
    x = tl.load(x_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, LOW)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(out_ptr + row * N + n, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, n]`` -> ``(e4m3 [rows, n], fp32 scales [rows, 1])``."""
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _quantize_rows_kernel[(rows,)](x, out, scale, N=n, BLOCK=block, FMAX=FP8_MAX, LOW=MIN_SCALE, PDL=PDL,
                                   num_warps=8 if block >= 4096 else 4, **launch_options())
    return out, scale
