"""The engine alone on a trace window: where its time goes, by kind of step (fresh prompt chunks, chunks after
cached keys, decode rows), with TFLOP/s for each.

    python -m bench.lab.trace_engine TRACE --count 100 --max-context 30000 --output-tokens 16 --concurrency 16 \\
        --engine "--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 32768" \\
        --out bench/out/trace-engine.json

Run one engine a process: a second engine in the same process finds the kernels compiled and the cuDNN plans built
that the first paid for (an A/B of 2026-11-29 that ran two in one process compared a cold engine with a warm one:
bench/RESULTS.md). Block tokens come from a 256-token vocabulary (any vocabulary gives the same work)."""
from __future__ import annotations

import argparse
import json

from bench import replay, replay_engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.trace_engine")
    ap.add_argument("trace")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=30000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--engine", default="--model llama-3.1-8b --load-format dummy --dtype bfloat16 "
                    "--max-model-len 32768")
    ap.add_argument("--block-size", type=int, default=512, help="tokens a block id becomes (as bench replay's)")
    ap.add_argument("--out", default="bench/out/trace-engine.json")
    args = ap.parse_args(argv)
    window = argparse.Namespace(trace=args.trace, block_size=args.block_size, trace_block=512, start=0, count=args.count,
                                duration=None, too_long="skip", output_tokens=args.output_tokens)
    requests, _ = replay.window(window, args.max_context)
    prompts = replay.Prompts(args.block_size, 256, "0:0")
    run = replay_engine.run(args.engine, requests, prompts.ids, args.concurrency)
    print(json.dumps({k: v for k, v in run.items() if k != "config"}, indent=1), flush=True)
    runs = [run]
    with open(args.out, "w") as f:
        json.dump({"argv": argv, "requests": len(requests), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
