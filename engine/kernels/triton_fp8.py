"""FP8-weight GEMM for few rows (decode at small batch) on ``triton_fewrow``'s kernel (CUDA).

``_scaled_mm`` at a batch of a few tokens runs a cuBLAS kernel tuned for
large tiles, well below the bandwidth that reading the weights allows. Here
the e4m3 weight tile is the left operand of an FP8 x FP8 tensor-core product
and the few rows of the already quantized activations the narrow right one
("swap AB"), split along K for the narrow projections, then both scales:
``y[t, o] = (xq[t] . wq[o]) * s_x[t] * s_w[o]`` -- the numbers of
``_scaled_mm`` (W8A8, per-token and per-channel scales). The activations come
quantized from the kernel before (``triton_layers``: the RMSNorms write e4m3
rows and their scales) or are quantized here in one more launch
(``triton_quant``). ``pdserve bench kernels --only w8`` times the tiles with
weights from memory; ``config_for`` holds what it measured best on an H200.
``fp8_linear.Fp8Linear`` sends batches of at most ``MAX_ROWS`` rows here on
CUDA."""
from __future__ import annotations


import torch

from .triton_fewrow import FewRowConfig, matmul, pick

MAX_ROWS = 64  # larger batches: _scaled_mm


W8Config = FewRowConfig  # (block_n, block_k, warps, stages, split_k)


def config_for(rows: int, n: int, k: int) -> W8Config:
    """The tile for ``rows`` rows times an ``[n, k]`` weight (``pdserve bench fp8``, H200, Mistral-7B shapes: 1.3-2x
    faster than bf16 ``F.linear`` at 1-64 rows, 1.4-2.5x than ``_scaled_mm``; up to 16 rows from ``pdserve bench
    kernels --only w8``/``fewrow``, whose weights come from memory, not L2: ``bench/results/kernels-w8-h200.md``,
    ``kernels-fewrow-h200.md``, ``kernels-fewrow-deep-h200.md``)."""
    chosen = pick("fp8", rows, n, k)  # a sweep's (``PDSERVE_FEWROW_CONFIGS``)
    if isinstance(chosen, W8Config):
        return chosen
    long_rows, wide = k >= 8192, n >= 16384  # down; gate_up
    if rows <= 32:  # bench/results/kernels-fewrow-h200.md
        if long_rows:  # down: K in two halves
            return W8Config(64, 512, 4, 4, 2) if rows <= 16 else W8Config(64, 256, 4, 5, 2)
        if wide:
            return W8Config(64, 256, 4, 4)
        if n > k:  # q/k/v
            return W8Config(64, 256, 4, 5)
        return W8Config(64, 512, 4, 4) if rows <= 16 else W8Config(64, 256, 4, 5, 2)  # o
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
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    matmul(x, weight, config or config_for(rows, n, k), out, scales=(scale, x_scale))
    return out
