"""``pdserve bench kernels``: every kernel of a decode step, timed, with the bytes it moves (or the FLOPs it does)
and the fraction of this device's limits measured in the same run: copy bandwidth (a device-to-device copy; bytes
read + written per second), read bandwidth (a sum) and the dense matmul rate.

* decode attention over the paged pool (``engine.kernels.triton_attention`` on CUDA, the torch form elsewhere) at
  ``--decode-cases`` (batch x context); ``--sweep`` times every ``DecodeConfig`` of a small grid and reports the
  best per case; FlashInfer / FlashAttention-3 paged decode where importable, else why not;
* prefill attention over packed fresh prompts (the engine's path: FlashAttention varlen on CUDA);
* the fused layer kernels (RMSNorm, residual add + RMSNorm, rotary + KV store, SiLU-times-up) per token count;
* the step's GEMMs at the model's shapes (weights read once: a bandwidth fraction at small batch);
* the batch-1 projections with their norm / SiLU-times-up fused (``engine.kernels.triton_gemv``, bf16 and FP8
  weights) against the launches they replace (``bench.kernels.fused``; ``--sweep``: their tiles too);
* ``--only fewrow``: the few-row GEMM (``engine.kernels.triton_fewrow``, tiles and K splits) at 1-64 rows against
  cuBLAS / the FP8 tile held before (``bench.kernels.fewrow``; picks to ``<out>-picks.json``);
* whole decode steps of the engine (dummy weights of ``--model``, a named shape): the captured graph's replay and
  ``Engine.step`` (host work included), against (weights + K/V bytes) / measured bandwidth.

    pdserve bench kernels [--model mistral-7b] [--sweep] [--out bench/out/kernels]

The command is here; its parts beside it: ``cases`` (one measurement per kind of kernel, and the device's limits),
``fused`` and ``fewrow`` (the projection kernels and their tile sweeps), ``steps`` (whole decode steps)."""
from __future__ import annotations

import json
import os
import platform
import sys
import time

from ..report import command_line


def add_arguments(p):
    p.add_argument("--model", default="mistral-7b", help="a named shape (engine.models.presets)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode-cases", default="1x8192,16x8192,64x2048,32x2048,1x4096")
    p.add_argument("--prefill-cases", default="16x512,1x8192")
    p.add_argument("--tokens", default="1,32,64", help="token counts of the layer kernels and GEMMs")
    p.add_argument("--step-cases", default="1x512,32x512,64x512,16x8192", help="whole decode steps, batch x context; "
                   "a context LO-HI spreads the rows' contexts evenly over it (as serving's rows are: 13x2000-4400)")
    p.add_argument("--step-count", type=int, default=20)
    p.add_argument("--buffer-mib", type=int, default=0, help="bytes of the bandwidth test (default 2048 CUDA, 256 CPU)")
    p.add_argument("--sweep", action="store_true", help="time a grid of decode attention configurations (and of "
                   "the batch-1 projection kernel's tiles: picks go to <out>-picks.json)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="decode attention over an "
                   "FP8 pool (quant.kv_fp8)")
    p.add_argument("--only", default="", help="comma-separated sections: decode,prefill,layers,gemms,fused,"
                   "steps (fused: the batch-1 projection kernel against the launches it replaces), or fewrow (a sweep "
                   "of triton_fewrow's tiles and K splits at 1-64 rows, bf16 and FP8; picks to <out>-picks.json)")
    p.add_argument("--tp", type=int, default=1, help="fused: one rank's projection shapes under this TP degree")
    p.add_argument("--out", default="bench/out/kernels")


def _cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",") if c]


def sweep_configs(ops) -> list:
    grid = [(tile, warps, stages, per_sm) for tile in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)
            for per_sm in (1, 2, 4, 8)]
    return [ops.DecodeConfig(tile=t, warps=w, stages=s, per_sm=p) for t, w, s, p in grid if not (t == 128 and s == 4)]


def alternatives() -> dict:
    """Other paged decode kernels this machine could compare, or why not."""
    out = {}
    for name, module in (("flashinfer", "flashinfer"), ("flash_attention_3", "flash_attn_interface"),
                         ("flash_attention_2", "flash_attn")):
        try:
            __import__(module)
            out[name] = "importable (not yet timed here)"
        except Exception as e:  # noqa: BLE001 - any import failure is the answer
            out[name] = f"not importable: {type(e).__name__}: {e}"
    return out


def fractions(rows: list, lim: dict) -> list:
    for r in rows:
        if "bytes" in r:
            r["GBps"] = r["bytes"] / r["ms"] / 1e6
            r["of_copy_bw"] = r["GBps"] / lim["copy_GBps"]
            r["of_read_bw"] = r["GBps"] / lim["read_GBps"]
        if "flops" in r:
            r["TFLOPs"] = r["flops"] / r["ms"] / 1e9
            r["of_matmul"] = r["TFLOPs"] / lim["matmul_TFLOPs"]
    return rows


def best_per_case(rows: list) -> list:
    best = {}
    for r in rows:
        if r.get("ok", True) and (r["name"] not in best or r["ms"] < best[r["name"]]["ms"]):
            best[r["name"]] = r
    return list(best.values())


def run(args) -> int:
    import torch

    from engine.kernels import paged
    from engine.loader import pick_device
    from engine.models.llama import ModelSpec
    from engine.models.presets import preset_config

    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    spec = ModelSpec.from_hf(preset_config(args.model))
    ops, layers = paged, None
    if device.type == "cuda":
        from engine.kernels import triton_attention as ops, triton_layers as layers
    only = set(args.only.split(",")) if args.only else {"decode", "prefill", "layers", "gemms", "fused",
                                                                     "steps"}
    tokens = [int(t) for t in args.tokens.split(",")]
    lim = limits_now(device, dtype, args.buffer_mib or (2048 if device.type == "cuda" else 256))
    report = {"command": command_line("kernels"), "model": args.model, "device": str(device), "dtype": args.dtype,
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
              "limits": lim, "alternatives": alternatives()}
    from . import cases as kc

    if "decode" in only:
        configs = sweep_configs(ops) if args.sweep and device.type == "cuda" else None
        rows = fractions(kc.decode_attention(ops, paged, spec, _cases(args.decode_cases), dtype, device, 16, configs,
                                             fp8=args.kv_cache_dtype == "fp8"), lim)
        report["decode_attention"] = best_per_case(rows)
        if configs:
            report["decode_sweep"] = rows
        _say("decode attention", report["decode_attention"])
    if "prefill" in only:
        report["prefill_attention"] = fractions(kc.prefill_attention(spec, _cases(args.prefill_cases), dtype, device), lim)
        _say("prefill attention", report["prefill_attention"])
    if "layers" in only:
        report["layer_kernels"] = fractions(kc.layer_kernels(layers, ops, spec, tokens, dtype, device), lim)
        _say("layer kernels", report["layer_kernels"])
    if "gemms" in only:
        report["gemms"] = fractions(kc.gemms(spec, tokens, dtype, device), lim)
        _say("gemms", report["gemms"])
    if "fused" in only and device.type == "cuda":
        from .fused import fused, write_picks

        rows, picks = fused(spec, dtype, device, args.sweep, args.tp)
        report["fused_projections"] = fractions([r for r in rows if "sweep" not in r["name"]], lim)
        report["fused_sweep"] = [r for r in rows if "sweep" in r["name"]]
        for r in report["fused_projections"]:
            r["note"] = f"unfused {r['unfused_ms']:.4f} ms: {r['speedup']:.2f}x; {r['config']}"
        _say("fused projections", report["fused_projections"])
        if picks:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            write_picks(picks, args.out)
    if "fewrow" in only and device.type == "cuda":
        from .fewrow import fewrow_sweep
        from .fused import write_picks

        rows, picks = fewrow_sweep(spec, dtype, device)
        report["fewrow_projections"] = fractions([r for r in rows if "sweep" not in r["name"]], lim)
        for r in report["fewrow_projections"]:
            r["note"] = f"{r['against']} {r['against_ms']:.4f} ms: {r['speedup']:.2f}x; {r['config']}"
        report["fewrow_sweep"] = [r for r in rows if "sweep" in r["name"]]
        _say("few-row projections", report["fewrow_projections"])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        write_picks(picks, args.out)
    if "steps" in only:
        from .steps import decode_steps, step_cases

        report["decode_steps"] = fractions(decode_steps(args, step_cases(args.step_cases), lim), lim)
        _say("decode steps", report["decode_steps"])
    write(report, args.out)
    return 0


def limits_now(device, dtype, mib: int) -> dict:
    from .cases import limits

    lim = limits(device, dtype, mib)
    print(f"limits: copy {lim['copy_GBps']:.0f} GB/s, read {lim['read_GBps']:.0f} GB/s, "
          f"matmul {lim['matmul_TFLOPs']:.1f} TFLOP/s", file=sys.stderr)
    return lim


def _say(title: str, rows: list) -> None:
    for r in rows:
        frac = f"{r['of_copy_bw']:.0%} of copy bw" if "of_copy_bw" in r else (
            f"{r['of_matmul']:.0%} of matmul" if "of_matmul" in r else "")
        print(f"{title}: {r['name']}: {r['ms']:.4f} ms {frac}", file=sys.stderr)


def table(report: dict) -> str:
    lim = report["limits"]
    out = [f"Measured limits: copy {lim['copy_GBps']:.0f} GB/s (read + write), read {lim['read_GBps']:.0f} GB/s, "
           f"{report['dtype']} matmul {lim['matmul_TFLOPs']:.1f} TFLOP/s.", ""]
    sections = [("decode_attention", "Paged decode attention"), ("prefill_attention", "Prefill attention"),
                ("layer_kernels", "Fused layer kernels"), ("gemms", "GEMMs"),
                ("fused_projections", "Batch-1 projections with their norm / SiLU fused (triton_gemv), weights from memory"),
                ("fewrow_projections", "Few-row projections on triton_fewrow (best tile and K split), weights from "
                 "memory, against cuBLAS (bf16) or the FP8 tile held before"),
                ("decode_steps", "Whole decode steps")]
    for key, title in sections:
        if key not in report:
            continue
        out += [f"## {title}", "", "| case | ms | GB/s | of copy bw | TFLOP/s | of matmul | note |", "|---" * 7 + "|"]
        for r in report[key]:
            gb = f"{r['GBps']:.0f}" if "GBps" in r else "-"
            fr = f"{r['of_copy_bw']:.0%}" if "of_copy_bw" in r else "-"
            tf = f"{r['TFLOPs']:.1f}" if "TFLOPs" in r else "-"
            fm = f"{r['of_matmul']:.0%}" if "of_matmul" in r else "-"
            note = r.get("note") or (str(r["config"]) if "config" in r else r.get("kernel", ""))
            out.append(f"| {r['name']} | {r['ms']:.4f} | {gb} | {fr} | {tf} | {fm} | {note} |")
        out.append("")
    out.append("Other paged decode kernels: " + "; ".join(f"{k}: {v}" for k, v in report["alternatives"].items()))
    return "\n".join(out) + "\n"


def write(report: dict, prefix: str) -> None:
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    report["written"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    with open(prefix + ".md", "w") as f:
        f.write(f"# Kernels ({report['model']} shape, {report['device']}, {report['dtype']})\n\n`{report['command']}`"
                f"\n\n{text}")
    print(text)
