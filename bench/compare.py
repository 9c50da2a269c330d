"""``pdserve bench compare``: one workload against the single-machine baseline
(colocated) and against disaggregated serving with each chosen transport; the
clusters are started and stopped here. Prints the table of the experiment
pdserve grew out of: prefill, serialize, transfer, deserialize, decode,
transfer overhead, TTFT (as the router timed it, and as the client saw it, with
its ratio to colocated), e2e, decode tok/s — per configuration. With
``--rounds R`` the configurations take turns R times (A B C A B C ...), each
turn a fresh cluster, so a machine that speeds up or slows down during the
run does not favour whichever configuration ran first; samples are pooled."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .report import command_line
from .serve import run_load, summarize

COLUMNS = [("prefill", "prefill"), ("serialize", "serialize"), ("transfer", "wire"), ("deserialize", "deserialize"),
           ("h2d", "h2d"), ("overlap", "overlap"), ("exposed", "exposed"), ("decode", "decode"),
           ("transfer overhead", "transfer_total"), ("TTFT router", "ttft"), ("e2e", "e2e")]


def add_arguments(p):
    p.add_argument("--transports", default="tcp", help="comma-separated; the colocated baseline always runs")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: closed loop)")
    p.add_argument("--prompt-len", default="871", help="the experiment's prompt length by default")
    p.add_argument("--max-tokens", default="128")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--rounds", type=int, default=2, help="turns each configuration takes, interleaved")
    p.add_argument("--out", default="bench/out/compare")


def measure(config: str, args) -> tuple[list, float]:
    from deploy.local import Cluster

    extra = ["--colocated"] if config == "colocated" else ["--transport", config]
    cluster = Cluster("--model", args.model, *extra, threads=args.threads).wait_ready()
    try:
        load = argparse.Namespace(url=cluster.url, model=None, endpoint="completions", requests=args.requests + 1,
                                  duration=None, concurrency=args.concurrency, rate=args.rate, prompt_len=args.prompt_len,
                                  max_tokens=args.max_tokens, prompts_jsonl=None, temperature=0.0, seed=0)
        rows, wall = asyncio.run(run_load(load))
    finally:
        cluster.stop()
    return rows[1:], wall


def pooled(turns: list) -> dict:
    rows = [r for rs, _ in turns for r in rs]
    result = summarize(rows, sum(wall for _, wall in turns))
    decode_rates = [(r["output_tokens"] - 1) / (r["pdserve"]["decode"] / 1e3) for r in rows
                    if not r["error"] and r["pdserve"].get("decode")]
    result["decode_tok_per_s"] = sum(decode_rates) / len(decode_rates) if decode_rates else 0.0
    return {"summary": result, "samples": rows}


def ttfts(summary: dict) -> tuple[float, float]:
    """Median TTFT as the client saw it (HTTP request to first token) and as the router timed it."""
    router = summary["pdserve_ms"].get("ttft", {}).get("median", 0.0)
    return (summary["ttft_ms"] or {}).get("median", 0.0), router


def table(results: dict) -> str:
    head = ("| configuration | " + " | ".join(f"{name} ms" for name, _ in COLUMNS)
            + " | TTFT client ms | TTFT / colocated (client, router) | decode tok/s | errors |")
    rows = [head, "|---" * (len(COLUMNS) + 5) + "|"]
    base = ttfts(results["colocated"]["summary"]) if "colocated" in results else (0.0, 0.0)
    for config, res in results.items():
        s = res["summary"]
        cells = [f"{s['pdserve_ms'][key]['median']:.2f}" if key in s["pdserve_ms"] else "-" for _, key in COLUMNS]
        client, router = ttfts(s)
        ratio = f"{client / base[0]:.3f}x, {router / base[1]:.3f}x" if base[0] and base[1] else "-"
        rows.append(f"| {config} | " + " | ".join(cells)
                    + f" | {client:.2f} | {ratio} | {s['decode_tok_per_s']:.1f} | {s['errors']} |")
    return "\n".join(rows)


def run(args) -> int:
    import json

    from .report import plot_cdfs
    from .transfer import environment

    if args.rounds < 1 or args.requests < 1:
        raise SystemExit("--rounds and --requests must be at least 1")
    configs = ["colocated", *[t for t in args.transports.split(",") if t]]
    turns = {c: [] for c in configs}
    for turn in range(args.rounds):
        for config in configs:
            print(f"== {config} (round {turn + 1}/{args.rounds})", file=sys.stderr, flush=True)
            turns[config].append(measure(config, args))
    results = {c: pooled(t) for c, t in turns.items()}
    text = table(results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    command = command_line("compare")
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "env": environment(), "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Colocated vs disaggregated ({args.model}, prompt {args.prompt_len}, output {args.max_tokens})\n\n"
                f"`{command}`\n\nMedians over {args.rounds} interleaved rounds of {args.requests} requests per configuration "
                f"(one warm-up per round excluded).\n\n{text}\n")
    plot_cdfs({c: {"ttft": [r["ttft_ms"] for r in res["samples"] if "ttft_ms" in r],
                   "e2e": [r["e2e_ms"] for r in res["samples"] if "ttft_ms" in r]} for c, res in results.items()},
              args.out + ".png")
    print(text)
    print(f"wrote {args.out}.json, {args.out}.md, {args.out}.png")
    return 0 if all(r["summary"]["errors"] == 0 for r in results.values()) else 1
