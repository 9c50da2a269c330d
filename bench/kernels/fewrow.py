"""``pdserve bench kernels --only fewrow``: the few-row GEMM kernel (``engine.kernels.triton_fewrow``) over a grid
of tiles and K splits, per decode projection (q/k/v, o, gate/up, down) and row count, with its weights read from
memory (copies rotating past L2, as a decode step reads them): bf16 weights at 16/32/64 rows against cuBLAS
(``F.linear``) in the same run, FP8 ones at 1/16/32 rows against the tile ``triton_fp8`` holds now. The best per
case goes to ``<out>-picks.json`` (``PDSERVE_FEWROW_CONFIGS`` makes an engine use them; a bf16 case where cuBLAS
won is picked as null: cuBLAS)."""
from __future__ import annotations

import torch

from .cases import timed_rotating
from .fused import rotating_layers, projection_shapes, timed_or_error

BF16_ROWS, FP8_ROWS = (16, 32, 64), (1, 16, 32)


def _grid(fp8: bool, rows: int) -> list:
    """Tiles of 64 output channels (a warpgroup's MMA) whose stages fit the H200's shared memory: K tiles,
    stages (more bytes in flight per SM), warps and K splits (more programs on the SMs)."""
    from engine.kernels.triton_fewrow import FewRowConfig as C

    if fp8:
        return [C(64, k, 4, stages, split) for k in (256, 512) for stages in (4, 5, 6) for split in (1, 2, 4)]
    if rows >= 64:
        return [C(64, 128, 4, stages, split) for stages in (3, 4) for split in (1, 2, 3, 4)]
    return [C(64, 128, warps, stages, split) for warps in (4, 8) for stages in (3, 4, 5, 6) for split in (1, 2)] + \
        [C(64, 256, 4, stages, split) for stages in (3, 4) for split in (1, 2, 4)]


def fewrow_sweep(spec, dtype, device) -> tuple[list, dict]:
    """Rows ``{"name", "ms", "bytes", "against_ms", "against", "speedup", "config"}`` (the best tile per case) plus
    every tile tried (``"sweep"`` in the name), and the picks ``{pick_key: config or None}``."""
    from engine.kernels import triton_fewrow, triton_fp8, triton_quant

    rows, picks = [], {}
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        for name, (out_f, in_f, _, _) in projection_shapes(spec).items():
            layers = rotating_layers(out_f, in_f, fp8, dtype, device)
            for m in FP8_ROWS if fp8 else BF16_ROWS:
                x = torch.randn(m, in_f, dtype=dtype, device=device)
                if fp8:
                    xq, xs = triton_quant.quantize_rows(x)
                    current = triton_fp8.config_for(m, out_f, in_f)
                    against, against_ms = f"triton_fp8 now {current.__dict__}", timed_rotating(
                        lambda layer: triton_fp8.w8_matmul(xq, layer.weight, layer.weight_scale, current,
                                                           x_scale=xs, out_dtype=dtype), layers, device)
                    run = lambda layer, c: triton_fp8.w8_matmul(xq, layer.weight, layer.weight_scale, c,  # noqa: E731
                                                                x_scale=xs, out_dtype=dtype)
                else:
                    against, against_ms = "cuBLAS", timed_rotating(
                        lambda layer: torch.nn.functional.linear(x, layer.weight), layers, device)
                    out = torch.empty(m, out_f, dtype=dtype, device=device)
                    run = lambda layer, c: triton_fewrow.matmul(x, layer.weight, c, out)  # noqa: E731
                tag = f"{kind} {name} m{m}"
                tried = [(timed_or_error(lambda layer: run(layer, c), layers, device), c) for c in _grid(fp8, m)]
                rows += [{"name": f"{tag} sweep", "config": c.__dict__, **t} for t, c in tried]
                ms, best = min(((t["ms"], c) for t, c in tried if "ms" in t), key=lambda p: p[0])
                faster = ms < against_ms * 0.98
                picks[triton_fewrow.pick_key(kind, m, out_f, in_f)] = best.__dict__ if faster or fp8 else None
                rows.append({"name": tag, "ms": ms, "against_ms": against_ms, "against": against,
                             "speedup": against_ms / ms, "config": best.__dict__,
                             "bytes": out_f * in_f * (1 if fp8 else 2) + m * (in_f + out_f) * 2})
            del layers
            torch.cuda.empty_cache()
    return rows, picks
