"""``pdserve bench fp8``: FP8 weights and the FP8 KV cache against bf16, side by side in one process.

* gemm: each projection's matmul at each batch, bf16 against FP8 (``_scaled_mm``
  and the few-row kernel of ``triton_fp8`` under a few tiles);
* decode: bf16 weights, then FP8 weights (``--quantization fp8``), each
  decoding ``--batches`` sequences of ``--prompt-len`` tokens (one engine at a
  time, freed before the next): tok/s and the ratio; the weight bytes read per
  step and their fraction of the read bandwidth measured in the same run;
* capacity: an engine per KV dtype with the same ``--kv-budget``, fed
  sequences of ``--context`` tokens until the pool holds no more: how many
  run at once, and the ratio (FP8 should hold about twice as many);
* long context: the decode step of ``--long-batch`` sequences at
  ``--context`` tokens with each KV dtype (attention reads half the bytes);
* agreement: cosine of the last-token logits of a few prompts, FP8 against
  bf16 (same random weights), and the control: bf16 with every projection
  weight off by 2.7% at random (e4m3's rounding error, nothing quantized):
  how much a random model's logits move for an error that size.

    pdserve bench fp8 --model mistral-7b --load-format dummy [--batches 1,32] [--context 8192] [--kv-budget 16G]"""
from __future__ import annotations

import gc
import json
import os
import random
import sys
import time

from .report import command_line


def add_arguments(p):
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--context", type=int, default=8192, help="context of the capacity and long-context runs")
    p.add_argument("--long-batch", type=int, default=16)
    p.add_argument("--kv-budget", default="16G", help="the KV pool of every engine here")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--skip", default="", help="comma list of parts to leave out: gemm, decode, capacity, long, "
                   "agreement")
    p.add_argument("--out", default="bench/out/fp8")


def _engine(args, **kw):
    from deploy.units import byte_size
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                                 kv_budget_bytes=byte_size(args.kv_budget), max_num_seqs=256,
                                 max_model_len=args.max_model_len or args.context + 256, **kw))
    engine.warm_up()
    return engine


def _free(engine) -> None:
    import torch

    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_part(args, rng) -> dict:
    import torch

    from .engine import decode_rate
    from .kernels.cases import limits
    from .kernels.steps import weight_bytes

    out = {}
    for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        engine = _engine(args, **kw)
        gbps = limits(engine.device, torch.bfloat16, 1024)["read_GBps"] if engine.device.type == "cuda" else None
        rows = [decode_rate(engine, b, args.prompt_len, args.decode_steps, rng) for b in _batches(args)]
        wbytes = weight_bytes(engine.model)
        for r in rows:
            r["weight_bytes"] = wbytes
            if gbps:
                r["weights_read_fraction"] = wbytes / (r["step_ms"] * 1e-3) / (gbps * 1e9)  # of the read bandwidth
            print(f"{name} weights, batch {r['batch']:>3}: {r['tok_per_s']:9.1f} tok/s ({r['step_ms']:.2f} ms/step, "
                  f"weights {wbytes / 1e9:.2f} GB)", file=sys.stderr)
        out[name] = {"rows": rows, "read_gb_per_s": gbps}
        _free(engine)
    out["speedup"] = {str(a["batch"]): a["tok_per_s"] / b["tok_per_s"]
                      for a, b in zip(out["fp8"]["rows"], out["bf16"]["rows"])}
    return out


def w8_configs(rows: int) -> list:
    """The tiles ``gemm_part`` tries for ``rows`` rows (``triton_fp8.W8Config``)."""
    from engine.kernels.triton_fp8 import W8Config

    return [W8Config(n, k, 4, s) for n in (32, 64, 128) for k in (128, 256, 512) for s in (3, 5)]


def gemm_part(args) -> list:
    """Each projection of the model's shape at each batch: bf16 ``F.linear``, and FP8 through ``_scaled_mm`` and
    through the few-row kernel under each of ``w8_configs`` (device time inside a CUDA graph), the FP8 ones on
    activations already quantized (as the fused norms hand them over; the quantization launch, where one is
    needed, timed apart); GB/s of weight bytes read."""
    import torch

    from engine.kernels import triton_fp8, triton_quant
    from engine.loader import _config
    from engine.config import EngineConfig
    from engine.models.llama import ModelSpec
    from engine.quant.fp8_linear import quantize_rows

    from .kernels.cases import timed

    spec = ModelSpec.from_hf(_config(EngineConfig(model=args.model, load_format=args.load_format)))
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d, h), "o": (h, spec.num_heads * d),
              "gate_up": (2 * inter, h), "down": (h, inter)}
    dev, rows = torch.device("cuda"), []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1)
        for m in _batches(args):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            xq, xs = triton_quant.quantize_rows(x)

            def scaled():
                return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
            row = {"gemm": name, "m": m, "n": n, "k": k,
                   "bf16_ms": timed(lambda: torch.nn.functional.linear(x, w), dev), "scaled_mm_ms": timed(scaled, dev),
                   "quantize_ms": timed(lambda: triton_quant.quantize_rows(x), dev)}
            if m <= 64:
                row["w8"] = {}
                for c in w8_configs(m):
                    try:
                        row["w8"][_name(c)] = timed(lambda c=c: triton_fp8.w8_matmul(xq, wq, ws, c, x_scale=xs), dev)
                    except Exception as e:  # noqa: BLE001 - a tile too large for this GPU (shared memory)
                        print(f"  {_name(c)}: {type(e).__name__}", file=sys.stderr)
                best = min(row["w8"], key=row["w8"].get)
                row["w8_best"], row["w8_best_ms"] = best, row["w8"][best]
            row["gb_per_s"] = {key: n * k * size / row[key] / 1e6 for key, size in
                               (("bf16_ms", 2), ("scaled_mm_ms", 1), ("w8_best_ms", 1)) if key in row}
            print(f"{name} m{m}: bf16 {row['bf16_ms'] * 1e3:.1f} us, scaled_mm {row['scaled_mm_ms'] * 1e3:.1f} us"
                  + (f", w8 {row['w8_best_ms'] * 1e3:.1f} us {row['w8_best']}" if "w8_best" in row else ""),
                  file=sys.stderr)
            rows.append(row)
    return rows


def _name(c) -> str:
    return f"n{c.block_n} k{c.block_k} w{c.warps} s{c.stages}"


def _batches(args) -> list[int]:
    return [int(b) for b in args.batches.split(",")]


def capacity_part(args, rng) -> dict:
    """Sequences of ``--context`` tokens running at once in the same KV budget, per KV dtype."""
    from .engine import _seqs, _vocab

    out = {}
    for name in ("auto", "fp8"):
        engine = _engine(args, kv_cache_dtype=name)
        vocab = _vocab(engine)
        want = engine.num_blocks // -(-(args.context + 1) // engine.block_size) + 4
        seqs = _seqs(engine, [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(want)],
                     [engine.max_len - args.context] * want)
        for s in seqs:
            engine.add(s)
        start, peak, stalled = time.perf_counter(), 0, 0
        while engine.scheduler.waiting and stalled < 24 and time.perf_counter() - start < 600:
            engine.step()  # admits while blocks allow; stops admitting (stalls) once the pool is full
            running = sum(1 for s in seqs if s.output_ids and not s.finished)
            stalled = 0 if running > peak else stalled + 1
            peak = max(peak, running)
            if engine.scheduler.preemptions:
                break
        out[name] = {"kv_dtype": str(engine.kv_dtype), "num_blocks": engine.num_blocks,
                     "kv_bytes_per_token": engine.kv_bytes_per_token, "running_at_once": peak,
                     "blocks_allow": engine.num_blocks // -(-(args.context + 1) // engine.block_size)}
        print(f"KV {name}: {peak} sequences of {args.context} tokens at once ({engine.num_blocks} blocks)",
              file=sys.stderr)
        for s in seqs:
            engine.free(s)
        _free(engine)
    out["ratio"] = out["fp8"]["running_at_once"] / max(1, out["auto"]["running_at_once"])
    return out


def long_part(args, rng) -> dict:
    from .engine import decode_rate

    out = {}
    for name in ("auto", "fp8"):
        engine = _engine(args, kv_cache_dtype=name)
        r = decode_rate(engine, args.long_batch, args.context - args.decode_steps - 16, args.decode_steps, rng)
        print(f"KV {name}: {args.long_batch} x {args.context}: {r['step_ms']:.2f} ms/step", file=sys.stderr)
        out[name] = r
        _free(engine)
    out["step_ratio"] = out["auto"]["step_ms"] / out["fp8"]["step_ms"]
    return out


def agreement_part(args) -> dict:
    import torch

    from engine import SamplingParams
    from engine.generate import generate_many

    prompts = ["The history of the printing press", "def fibonacci(n):", "Bonjour, je voudrais"]
    logits = {}
    variants = (("bf16", {}), ("fp8_weights", {"quantization": "fp8"}), ("fp8_kv", {"kv_cache_dtype": "fp8"}),
                ("bf16_noise", {}))
    for name, kw in variants[:: 1 if torch.cuda.is_available() else 2]:  # FP8 weights run on CUDA only
        engine = _engine(args, **kw)
        if name == "bf16_noise":  # the control: bf16 weights off by e4m3's own relative error, at random
            _perturb(engine.model, 0.027)
        rows = []

        def keep(h, head=engine.model.logits):
            out = head(h)
            rows.append(out[-1].float().cpu())
            return out
        engine.model.logits = keep
        for p in prompts:  # a prefix-cached second pass reads the prompt's K/V back from the pool
            generate_many(engine, [p * 4], [SamplingParams(max_tokens=1, temperature=0)])
            generate_many(engine, [p * 4 + " and"], [SamplingParams(max_tokens=1, temperature=0)])
        logits[name] = rows[1::2]
        _free(engine)
    cos = torch.nn.functional.cosine_similarity
    return {name: [float(cos(a, b, dim=0)) for a, b in zip(logits[name], logits["bf16"])]
            for name in logits if name != "bf16"}


def _perturb(model, relative: float) -> None:
    """Every projection weight times ``1 + relative * N(0, 1)`` (seeded): how sensitive the model is to an error
    the size of FP8 rounding, with nothing quantized."""
    import torch

    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for layer in model.owned_layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.ffn, "gate_up_proj", None),
                        getattr(layer.ffn, "down_proj", None)):
                if lin is None:  # a sparse block's experts: left as they are
                    continue
                noise = torch.randn(lin.weight.shape, generator=gen, device=lin.weight.device)
                lin.weight.mul_(1 + relative * noise.to(lin.weight.dtype))


def run(args) -> int:
    import torch

    rng = random.Random(0)
    skip = set(filter(None, args.skip.split(",")))
    if not torch.cuda.is_available():
        skip |= {"decode", "gemm"}  # FP8 weights need a GPU with FP8 tensor cores
        print("no CUDA GPU: the FP8-weight decode comparison is left out", file=sys.stderr)
    report = {"command": command_line("fp8"), "model": args.model,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    parts = (("gemm", lambda: gemm_part(args)), ("decode", lambda: decode_part(args, rng)), ("capacity", lambda: capacity_part(args, rng)),
             ("long_context", lambda: long_part(args, rng)), ("agreement", lambda: agreement_part(args)))
    for name, part in parts:
        if name.split("_")[0] not in skip:
            report[name] = part()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0


def markdown(r: dict) -> str:
    lines = [f"# FP8 against bf16 ({r['model']}, {r['gpu'] or 'cpu'})", "", f"`{r['command']}`", ""]
    if "gemm" in r:
        lines += ["| GEMM | m | bf16 us | FP8 _scaled_mm us | FP8 few-row kernel us (tile) | quantize us |",
                  "|---|---:|---:|---:|---|---:|"]
        for g in r["gemm"]:
            w8 = f"{g['w8_best_ms'] * 1e3:.1f} {g['w8_best']}" if "w8_best" in g else ""
            lines.append(f"| {g['gemm']} | {g['m']} | {g['bf16_ms'] * 1e3:.1f} | {g['scaled_mm_ms'] * 1e3:.1f} | {w8} | "
                         f"{g['quantize_ms'] * 1e3:.1f} |")
        lines.append("")
    if "decode" in r:
        lines += ["| batch | bf16 tok/s | FP8 weights tok/s | speedup | FP8 ms/step | FP8 weight bytes / step time, of read bw |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for a, b in zip(r["decode"]["bf16"]["rows"], r["decode"]["fp8"]["rows"]):
            frac = b.get("weights_read_fraction")
            lines.append(f"| {a['batch']} | {a['tok_per_s']:.1f} | {b['tok_per_s']:.1f} | "
                         f"{b['tok_per_s'] / a['tok_per_s']:.2f}x | {b['step_ms']:.2f} | "
                         f"{'' if frac is None else f'{frac:.0%}'} |")
        lines.append("")
    if "capacity" in r:
        c = r["capacity"]
        lines += [f"KV capacity at the same budget: bf16 {c['auto']['running_at_once']} sequences, FP8 "
                  f"{c['fp8']['running_at_once']} ({c['ratio']:.2f}x)", ""]
    if "long_context" in r:
        lc = r["long_context"]
        lines += [f"Long context decode step: bf16 KV {lc['auto']['step_ms']:.2f} ms, FP8 KV {lc['fp8']['step_ms']:.2f}"
                  f" ms ({lc['step_ratio']:.2f}x)", ""]
    if "agreement" in r:
        lines += ["Last-token logits cosine against bf16: " + ", ".join(
            f"{k} {min(v):.4f} (min of {len(v)})" for k, v in r["agreement"].items()), ""]
    return "\n".join(lines)
