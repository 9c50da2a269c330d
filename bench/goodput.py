"""``pdserve bench goodput``: the highest request rate each serving
configuration sustains while at least ``--attainment`` (90%) of requests meet
the SLO (TTFT and TPOT limits), the measure DistServe uses for prefill/decode
disaggregation.

Each ``--config NAME=ARGS`` is a ``pdserve up`` started here (ARGS plus the
shared ``--up-args``), e.g. ``1p1d=--transport nccl`` and
``2x-colocated=--colocated --decode 2 --gpus 2``. Per configuration, after a
short warm-up, Poisson arrivals at each of ``--rates`` (``--requests`` each,
or ``--duration`` seconds of them; the first ``--warmup-requests`` not
counted; the same seeded workload everywhere, ``--workload mixed`` too)
give the SLO attainment per rate (errors count as misses; SLOs on TTFT,
TPOT and, when given, each request's ITL p99 and longest stall); the sweep
stops after two rates below half the target. Then closed-loop runs at each of ``--ttft-concurrency`` record TTFT
median and p90. Writes JSON, Markdown and a plot of attainment vs rate."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex

from .report import command_line
from .serve import run_load, within
from .stats import summary
from .workload import WORKLOADS
from .transfer import environment


def add_arguments(p):
    p.add_argument("--config", action="append", required=True, help="NAME=pdserve up arguments (repeatable)")
    p.add_argument("--up-args", default="", help="arguments every configuration's pdserve up gets")
    p.add_argument("--rates", default="1,2,4,8", help="requests/s, comma-separated, ascending")
    p.add_argument("--requests", type=int, default=200, help="requests per rate")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (instead)")
    p.add_argument("--warmup-requests", type=int, default=10, help="first requests of each rate not counted")
    p.add_argument("--workload", choices=WORKLOADS, default="uniform")
    p.add_argument("--slo-itl-p99-ms", type=float, default=None)
    p.add_argument("--slo-stall-ms", type=float, default=None)
    p.add_argument("--prompt-len", default="2000:8000")
    p.add_argument("--max-tokens", default="64:256")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--ttft-concurrency", default="4,16", help="closed-loop runs for TTFT under load ('' for none)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/goodput")


def slo_of(args) -> dict:
    return {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms,
            "itl_p99_ms": getattr(args, "slo_itl_p99_ms", None), "stall_ms": getattr(args, "slo_stall_ms", None)}


def attained(rows: list[dict], slo: dict, warmup: int = 0) -> float:
    rows = [r for r in rows if r.get("index", warmup) >= warmup]
    good = [r for r in rows if not r["error"] and "ttft_ms" in r and within(r, slo)]
    return len(good) / max(1, len(rows))


def _load(args, url: str, rate: float | None, concurrency: int, requests: int, seed: int, duration=None):
    ns = argparse.Namespace(url=url, model=None, endpoint="completions", requests=requests, duration=duration,
                            concurrency=concurrency, rate=rate, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                            prompts_jsonl=None, temperature=0.0, seed=seed, workload=getattr(args, "workload", "uniform"))
    return asyncio.run(run_load(ns))


def measure(name: str, up_args: list[str], args) -> dict:
    from deploy.local import Cluster

    cluster = Cluster(*up_args, ready_timeout=args.ready_timeout).wait_ready()
    result = {"name": name, "up_args": up_args, "rates": [], "ttft_under_load": {}}
    try:
        _load(args, cluster.url, None, 2, 4, args.seed + 99)  # warm-up
        below = 0
        for rate in [float(r) for r in args.rates.split(",")]:
            rows, wall = _load(args, cluster.url, rate, 100_000, args.requests, args.seed, getattr(args, "duration", None))
            warmup = getattr(args, "warmup_requests", 0)
            share = attained(rows, slo_of(args), warmup)
            timed = [r for r in rows if "ttft_ms" in r and r.get("index", warmup) >= warmup]
            where = [r["pdserve"].get("disagg") for r in timed if r["pdserve"].get("disagg")]
            point = {"rate": rate, "attainment": share, "errors": sum(1 for r in rows if r["error"]), "wall_s": wall,
                     "requests": len(rows), "ttft_ms": summary(r["ttft_ms"] for r in timed),
                     "tpot_ms": summary(r["tpot_ms"] for r in timed),
                     "itl_p99_ms": summary(r["itl_p99_ms"] for r in timed),
                     "stall_ms": summary(r["stall_ms"] for r in timed),
                     "disagg": {w: where.count(w) for w in sorted(set(where))}}
            result["rates"].append(point)
            print(f"  {name}: {rate:g} req/s -> {share:.0%} within SLO (TTFT p90 "
                  f"{(point['ttft_ms'] or {}).get('p90', 0):.0f} ms, TPOT p90 {(point['tpot_ms'] or {}).get('p90', 0):.1f} ms, "
                  f"ITL p99 median {(point['itl_p99_ms'] or {}).get('median', 0):.1f} ms)",
                  flush=True)
            below = below + 1 if share < args.attainment / 2 else 0
            if below >= 2:
                break
        for c in [int(c) for c in args.ttft_concurrency.split(",") if c]:
            rows, _ = _load(args, cluster.url, None, c, max(2 * c, 16), args.seed + c)
            result["ttft_under_load"][str(c)] = summary(r["ttft_ms"] for r in rows if "ttft_ms" in r)
    finally:
        cluster.stop()
    ok = [p["rate"] for p in result["rates"] if p["attainment"] >= args.attainment]
    result["goodput_rate"] = max(ok) if ok else 0.0
    return result


def table(results: list[dict], args) -> str:
    rates = sorted({p["rate"] for r in results for p in r["rates"]})
    rows = ["| configuration | goodput (req/s) | " + " | ".join(f"{x:g}/s" for x in rates) + " | TTFT p50/p90 by concurrency |",
            "|---" * (len(rates) + 3) + "|"]
    for r in results:
        share = {p["rate"]: f"{p['attainment']:.0%}" for p in r["rates"]}
        ttft = ", ".join(f"c{c}: {s['median']:.0f}/{s['p90']:.0f} ms" for c, s in r["ttft_under_load"].items() if s)
        rows.append(f"| {r['name']} | {r['goodput_rate']:g} | " + " | ".join(share.get(x, "-") for x in rates)
                    + f" | {ttft} |")
    return "\n".join(rows)


def plot(results: list[dict], args, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot([p["rate"] for p in r["rates"]], [100 * p["attainment"] for p in r["rates"]], marker="o", label=r["name"])
    ax.axhline(100 * args.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel(f"% within TTFT<={args.slo_ttft_ms:g} ms, TPOT<={args.slo_tpot_ms:g} ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args) -> int:
    configs = []
    for spec in args.config:
        name, sep, rest = spec.partition("=")
        if not sep or not name:
            print(f"error: --config {spec!r} is not NAME=ARGS", flush=True)
            return 2
        configs.append((name, shlex.split(rest) + shlex.split(args.up_args)))
    results = [measure(name, up, args) for name, up in configs]
    base = results[-1]["goodput_rate"]
    for r in results:
        r["vs_last"] = r["goodput_rate"] / base if base else None
    report = {"command": command_line("goodput"), "slo": {**slo_of(args), "attainment": args.attainment},
              "workload": {"kind": args.workload, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "requests_per_rate": args.requests, "duration_s": args.duration,
                           "warmup_requests": args.warmup_requests}, "results": results, "env": environment()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = table(results, args)
    with open(args.out + ".md", "w") as f:
        f.write(f"`{report['command']}`\n\n{md}\n")
    plot(results, args, args.out + ".png")
    print(md)
    print("goodput ratios vs " + results[-1]["name"] + ": " + ", ".join(
        f"{r['name']} {r['vs_last']:.2f}x" if r["vs_last"] is not None else f"{r['name']} -" for r in results))
    print(f"wrote {args.out}.json, .md, .png")
    return 0
