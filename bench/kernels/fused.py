"""``pdserve bench kernels --only fused``: each decode projection of one row (batch 1) on ``triton_gemv`` against
the launches it replaces, in the same run: q/k/v (add + RMSNorm, GEMM), o (GEMM), gate/up (add + RMSNorm, GEMM,
SiLU-times-up) and down (GEMM), bf16 weights and FP8 ones (where FP8 without it means: the norm writing e4m3,
``triton_fp8``'s few-row FP8 GEMM, a quantization launch before o and down). Weights rotate through copies
larger than the L2 cache together, so every call reads them from memory as a decode step does. ``--sweep`` times
a grid of tiles per projection and writes the best (``<out>-picks.json``; ``PDSERVE_GEMV_CONFIGS`` makes an
engine use them)."""
from __future__ import annotations

import json

import torch

from .cases import copies_past_l2, timed_rotating


def projection_shapes(spec, tp: int = 1) -> dict:
    """``{name: (out, in, normed input, SiLU after)}`` of one rank of a TP=``tp`` group: q/k/v and gate/up split
    by output (KV heads replicated where there are fewer than ranks), o and down by input."""
    from engine.parallel.heads import HeadShard

    shard = HeadShard(spec.num_heads, spec.num_kv_heads, tp)
    h, d, inter, heads, kv_heads = spec.hidden_size, spec.head_dim, spec.intermediate_size // tp, shard.heads, shard.kv_heads
    return {"qkv": ((heads + 2 * kv_heads) * d, h, True, False), "o": (h, heads * d, False, False),
            "gate_up": (2 * inter, h, True, True), "down": (h, inter, False, False)}


def rotating_layers(out_f: int, in_f: int, fp8: bool, dtype, device) -> list:
    from engine.quant.fp8_linear import Fp8Linear

    def make():
        lin = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype).requires_grad_(False)
        torch.nn.init.normal_(lin.weight, std=in_f ** -0.5)
        return Fp8Linear.of(lin) if fp8 else lin

    layers = copies_past_l2(make, out_f * in_f * (1 if fp8 else 2), device)
    if fp8:  # the engine's kernels for FP8 projections (``decode_path.fp8_kernels``)
        from engine.kernels import triton_fp8, triton_quant

        for layer in layers:
            layer.quantize_activations = triton_quant.quantize_rows
            layer.few_rows, layer.few_rows_max = triton_fp8.w8_matmul, triton_fp8.MAX_ROWS
    return layers


def _unfused(normed: bool, silu: bool, fp8: bool, x, r, w, layer):
    """The launches the fused kernel replaces (what the engine ran before)."""
    from engine.kernels import triton_layers

    if fp8:
        h = triton_layers.rmsnorm_fp8(x, w, 1e-5, r)[0] if normed else x
        y = layer(h)
    else:
        h = triton_layers.add_rmsnorm(x, r, w, 1e-5)[0] if normed else x
        y = torch.nn.functional.linear(h, layer.weight)
    return triton_layers.silu_mul(y) if silu else y


def _fused(normed: bool, silu: bool, x, r, w, layer, config=None):
    from engine.kernels import triton_gemv

    rows = triton_gemv.defer(x, r, w, 1e-5)[0] if normed else x
    return triton_gemv.linear(rows, layer, silu=silu, config=config)


def fused(spec, dtype, device, sweep: bool = False, tp: int = 1) -> tuple[list, dict]:
    """Rows ``{"name", "ms", "bytes", "unfused_ms", "speedup"}`` per projection and weight dtype (one rank's shapes
    under TP=``tp``); with ``sweep``, the tiles tried (in the rows) and the best per projection
    ``{shape_key: config}``."""
    from engine.kernels import triton_gemv

    rows, picks = [], {}
    for fp8 in (False, True):
        for name, (out_f, in_f, normed, silu) in projection_shapes(spec, tp).items():
            layers = rotating_layers(out_f, in_f, fp8, dtype, device)
            n = out_f // 2 if silu else out_f
            tag = f"{name}{' fp8' if fp8 else ''} m1"
            x, r = (torch.randn(1, in_f, dtype=dtype, device=device) for _ in range(2))
            w = torch.ones(in_f, dtype=dtype, device=device)
            before = timed_rotating(lambda layer: _unfused(normed, silu, fp8, x, r, w, layer), layers, device)
            tried = [(timed_or_error(lambda layer: _fused(normed, silu, x, r, w, layer, c), layers, device), c)
                     for c in (_grid() if sweep and not fp8 else [None])]  # FP8 layers keep triton_fp8
            rows += [{"name": f"{tag} sweep", "config": c.__dict__, **t} for t, c in tried if c is not None]
            ms, best = min(((t["ms"], c) for t, c in tried if "ms" in t), key=lambda p: p[0])
            if best is not None:
                picks[triton_gemv.shape_key(n, in_f, silu, fp8)] = best.__dict__
            rows.append({"name": tag, "ms": ms, "unfused_ms": before, "speedup": before / ms,
                         "bytes": out_f * in_f * (1 if fp8 else 2) + (in_f + n) * 2,
                         "config": (best or triton_gemv.config_for(n, in_f, silu, fp8)).__dict__})
            del layers
            torch.cuda.empty_cache()
    return rows, picks


def timed_or_error(fn, layers, device) -> dict:
    try:
        return {"ms": timed_rotating(fn, layers, device)}
    except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU
        return {"error": str(e)[:120]}


def _grid() -> list:
    """Tiles whose fp32 accumulators fit the registers (at most 64 a thread, two for gate/up)."""
    from engine.kernels.triton_gemv import GemvConfig

    return [GemvConfig(n, k, warps, 3, ahead) for warps in (4, 8) for n in (1, 2, 4, 8, 16)
            for k in (256, 512, 1024) for ahead in (1, 2)
            if n * k <= 2048 * warps // ahead and n * k >= 32 * 4 * warps]  # 32 rows a program never won a sweep


def write_picks(picks: dict, prefix: str) -> None:
    with open(f"{prefix}-picks.json", "w") as f:
        json.dump(picks, f, indent=1)
