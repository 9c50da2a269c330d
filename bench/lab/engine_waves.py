"""Serving waves without the server: ``bench serve``'s closed loop run on the engine in this process, to tell
what the engine costs from what the router and workers add.

    python -m bench.lab.engine_waves --model mistral-7b --load-format dummy --concurrency 64 --requests 256

Waves as ``bench/gpu/decode.sh serve`` runs them: ``first`` (the prompts of seed 0), ``second`` (seed 1),
``repeat`` (seed 0 again: every prompt in the prefix cache). ``concurrency`` sequences are kept in the engine;
one that finishes is replaced by the next prompt before the following step. Per wave: output tok/s, TTFT (from
``add`` to the step that returned the first token), the steps by kind (decode only / decode with prompt tokens /
prompts only) with their count, mean ms and prompt tokens, and the prompt tokens taken from the cache.
``--profile WAVE``: a torch profile of that wave's steps (top kernels by device time). ``--step-prefill-tokens
A,B,..``: the waves again under each cap on the prompt tokens of a step that also decodes (``none``: no cap), new
prompts each time (seeds offset by 100 per cap)."""
from __future__ import annotations

import argparse
import json
import sys
import statistics
import time


def _sequences(engine, seed: int, count: int, prompt_len: int, max_tokens: int) -> list:
    from planner.workload import build
    from engine import SamplingParams
    from engine.sequence import Sequence

    return [Sequence.create(f"w{seed}-{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                                                      ignore_eos=True), engine.tokenizer, engine.max_len)
            for i, r in enumerate(build(count, str(prompt_len), str(max_tokens), seed))]


def wave(engine, seqs: list, concurrency: int) -> dict:
    """Run ``seqs`` closed-loop, ``concurrency`` at a time; what it cost."""
    waiting, live, added, first = list(reversed(seqs)), set(), {}, {}
    kinds: dict[str, list] = {"decode": [], "mixed": [], "prompts": []}
    cached_before, done, start = engine.cached_tokens, 0, time.perf_counter()
    while waiting or live:
        while waiting and len(live) < concurrency:
            seq = waiting.pop()
            engine.add(seq)
            live.add(seq)
            added[id(seq)] = time.perf_counter()
        t = time.perf_counter()
        out = engine.step()
        ms = (time.perf_counter() - t) * 1e3
        if out.refused:
            raise RuntimeError(f"{len(out.refused)} sequences do not fit in the KV pool")
        prompt = out.batch_tokens - out.decode_rows
        kind = "decode" if not prompt else "mixed" if out.decode_rows else "prompts"
        if out.scheduled:
            kinds[kind].append((ms, prompt))
        now = time.perf_counter()
        for seq in (tok.seq for tok in out.tokens):
            first.setdefault(id(seq), now - added[id(seq)])
        for seq in [s for s in live if s.finished]:
            live.discard(seq)
            done += len(seq.output_ids)
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"requests": len(seqs), "wall_s": wall, "output_tok_s": done / wall,
            "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2], "ttft_ms_p90": 1e3 * ttft[int(len(ttft) * 0.9)],
            "cached_prompt_tokens": engine.cached_tokens - cached_before,
            "steps": {k: {"count": len(v), "mean_ms": statistics.fmean(m for m, _ in v) if v else 0.0,
                          "total_ms": sum(m for m, _ in v), "prompt_tokens": sum(p for _, p in v)}
                      for k, v in kinds.items()}}


def summary(run: dict) -> str:
    steps = "; ".join(f"{k} {v['count']} x {v['mean_ms']:.1f} ms ({v['prompt_tokens']} prompt tokens)"
                      for k, v in run["steps"].items())
    return (f"{run['wave']} cap {run['step_prefill_tokens']}: {run['output_tok_s']:.0f} tok/s, TTFT p50 "
            f"{run['ttft_ms_p50']:.0f} ms p90 {run['ttft_ms_p90']:.0f}, cached {run['cached_prompt_tokens']}; {steps}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.engine_waves")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--waves", default="first:0,second:1,repeat:0")
    ap.add_argument("--profile", default="", help="a wave to profile (torch profiler, top kernels by device time)")
    ap.add_argument("--step-prefill-tokens", default="none", help="caps to sweep, e.g. none,2048,1024")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len))
    engine.warm_up()
    report = {"command": "python -m bench.lab.engine_waves " + " ".join(sys.argv[1:] if argv is None else argv), "runs": []}
    for n, cap in enumerate(args.step_prefill_tokens.split(",")):
        engine.prefill_budget.fixed = None if cap == "none" else int(cap)
        engine.scheduler.prefill_cap = engine.prefill_budget.tokens()
        for item in args.waves.split(","):
            name, seed = item.split(":")
            seqs = _sequences(engine, int(seed) + 100 * n, args.requests, args.prompt_len, args.max_tokens)
            if name == args.profile and n == 0:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    result = wave(engine, seqs, args.concurrency)
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))
            else:
                result = wave(engine, seqs, args.concurrency)
            report["runs"].append({"wave": name, "step_prefill_tokens": cap, **result})
            print(summary(report["runs"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
