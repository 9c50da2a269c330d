"""``pdserve bench goodput``: the highest request rate each serving
configuration sustains while at least ``--attainment`` (90%) of requests meet
the SLO (TTFT and TPOT limits), the measure DistServe uses for prefill/decode
disaggregation.

Each ``--config NAME=ARGS`` is a ``pdserve up`` started here (ARGS plus the
shared ``--up-args``), e.g. ``1p1d=--transport nccl`` and
``2x-colocated=--colocated --decode 2 --gpus 2``, once; every workload of
``--workload`` (``uniform`` in the ranges given, ``mid``, ``long``, ``mixed``,
comma-separated) runs against it in turn. Per workload, after a short
warm-up, Poisson arrivals at each rate (``--requests`` each, or
``--duration`` seconds of them, stretched at low rates until ``--min-timed``
requests count; the first ``--warmup-requests`` not counted;
the same seeded workload everywhere, distinct prompts at each rate: a
prompt repeated from an earlier rate would hit the prefix cache) give the SLO
attainment (errors count as
misses; SLOs on TTFT, TPOT and, when given, each request's ITL p99 and
longest stall). Rates: ``--rates`` in order until two are below half the
target, or ``--search R``: double from R while the SLO is met, then bisect.
A request still running TTFT + TPOT x its workload's longest output (+2 s)
after the last arrival can no longer meet the SLO: it is cancelled and
counted as a miss, so an overloaded rate ends rather than drains; the next
rate starts once no worker has anything in flight (the wait is recorded:
work a cancelled request left behind shows there). Each rate also records
every worker's step times over it (decode-only and prompt steps, the gaps
between steps, from /health). Then
closed-loop runs at each of ``--ttft-concurrency`` record TTFT median and
p90. Writes JSON, Markdown and a plot of attainment vs rate per workload
(``OUT-<workload>`` when several), rewritten after each configuration."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex

from .health import busiest, step_delta, step_times, wait_idle
from .report import command_line
from .serve import PHASES, run_load, within
from planner.stats import summary
from planner.workload import WORKLOADS, longest_output
from .transfer import environment


def add_arguments(p):
    p.add_argument("--config", action="append", required=True, help="NAME=pdserve up arguments (repeatable)")
    p.add_argument("--up-args", default="", help="arguments every configuration's pdserve up gets")
    p.add_argument("--rates", default="1,2,4,8", help="requests/s, comma-separated, ascending")
    p.add_argument("--requests", type=int, default=200, help="requests per rate")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (instead)")
    p.add_argument("--warmup-requests", type=int, default=10, help="first requests of each rate not counted")
    p.add_argument("--min-timed", type=int, default=20, help="requests each rate counts at least: a low rate's "
                   "--duration is stretched to send them (0: as given)")
    p.add_argument("--workload", default="uniform", help=f"one or more of {', '.join(WORKLOADS)}, comma-separated "
                   "(each configuration started once, every workload run against it)")
    p.add_argument("--search", type=float, default=None, help="instead of --rates: from this rate, double while the "
                   "SLO is met, then bisect (--probes rates in all)")
    p.add_argument("--probes", type=int, default=5)
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


def workloads_of(args) -> list[str]:
    names = [w for w in str(getattr(args, "workload", "uniform")).split(",") if w]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"--workload {args.workload!r}: each of {WORKLOADS}, comma-separated")
    return names


def give_up_s(args, workload: str) -> float | None:
    """How long after the last arrival a request may still run and meet the SLO (TTFT + TPOT x its longest output,
    + 2 s): later ones are cancelled and counted as misses, so an overloaded rate ends instead of draining."""
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        return None
    return (args.slo_ttft_ms + args.slo_tpot_ms * longest_output(workload, args.max_tokens)) / 1e3 + 2.0


def _load(args, url: str, rate: float | None, concurrency: int, requests: int, seed: int, duration=None,
          workload: str = "uniform", give_up=None):
    ns = argparse.Namespace(url=url, model=None, endpoint="completions", requests=requests, duration=duration,
                            concurrency=concurrency, rate=rate, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                            prompts_jsonl=None, temperature=0.0, seed=seed, workload=workload, give_up_s=give_up)
    return asyncio.run(run_load(ns))


def rates_to_try(args, probe) -> None:
    """``probe(rate)`` gives the attainment. ``--search R``: from R, double while met, then bisect between the
    highest met and the lowest missed, ``--probes`` rates in all. Else ``--rates`` in order, until two are below
    half the target."""
    target, start = args.attainment, getattr(args, "search", None)
    if start:
        met, missed, rate, tried = 0.0, None, start, set()
        for _ in range(getattr(args, "probes", 5)):
            tried.add(rate)
            if probe(rate) >= target:
                met = rate
            else:
                missed = rate
            rate = float(f"{(met * 2 if missed is None else (met + missed) / 2 if met else missed / 2):.2g}")
            if rate in tried:
                return
        return
    below = 0
    for rate in [float(r) for r in args.rates.split(",")]:
        below = below + 1 if probe(rate) < target / 2 else 0
        if below >= 2:
            return


def probe_length(args, rate: float) -> tuple[int, float | None]:
    """Requests and seconds of arrivals for one rate: enough for ``--min-timed`` requests after the warm-up ones
    (the 70B sweeps of 2026-11-26 (646033b) judged rates of 0.25-0.5 req/s by one to five requests)."""
    least = getattr(args, "warmup_requests", 0) + getattr(args, "min_timed", 0)
    duration = getattr(args, "duration", None)
    if duration is not None:
        return args.requests, max(duration, least / rate)
    return max(args.requests, least), None


def point_of(rows, wall, rate, args) -> dict:
    warmup = getattr(args, "warmup_requests", 0)
    timed = [r for r in rows if "ttft_ms" in r and r.get("index", warmup) >= warmup]
    where = [r["pdserve"].get("disagg") for r in timed if r["pdserve"].get("disagg")]
    return {"rate": rate, "attainment": attained(rows, slo_of(args), warmup),
            "errors": sum(1 for r in rows if r["error"]), "wall_s": wall, "requests": len(rows),
            "timed": sum(1 for r in rows if r.get("index", warmup) >= warmup),
            "abandoned": sum(1 for r in rows if (r["error"] or "").startswith("abandoned")),
            "ttft_ms": summary(r["ttft_ms"] for r in timed), "tpot_ms": summary(r["tpot_ms"] for r in timed),
            "itl_p99_ms": summary(r["itl_p99_ms"] for r in timed), "stall_ms": summary(r["stall_ms"] for r in timed),
            "second_token_ms": summary(r["itl_ms"][0] for r in timed if r["itl_ms"]),  # P/D: the KV handoff's gap
            "pdserve_ms": phase_summaries(timed), "disagg": {w: where.count(w) for w in sorted(set(where))}}


def phase_summaries(rows) -> dict:
    """pdserve's per-request phases (queue, prefill, wire, exposed, decode, ...), summarised over ``rows``."""
    out = {}
    for phase in PHASES:
        s = summary(r["pdserve"][phase] for r in rows if isinstance(r["pdserve"].get(phase), (int, float)))
        if s:
            out[phase] = s
    return out


def probe_seed(seed: int, workload: str, rate: float) -> int:
    """The workload's seed for one rate: the same rate gets the same requests in every configuration, but no two
    rates (nor workloads) share prompts: a prompt seen at an earlier rate would be served from the prefix cache
    (no prefill at all), which no real workload of distinct prompts gets."""
    return seed + round(rate * 1000) + 1_000_003 * (WORKLOADS.index(workload) + 1)


def sweep(name: str, url: str, args, workload: str) -> dict:
    result = {"name": name, "workload": workload, "rates": [], "ttft_under_load": {}}

    def probe(rate):
        drained = wait_idle(url)
        before = step_times(url)
        requests, duration = probe_length(args, rate)
        rows, wall = _load(args, url, rate, 100_000, requests, probe_seed(args.seed, workload, rate), duration,
                           workload, give_up_s(args, workload))
        point = point_of(rows, wall, rate, args)
        point["step_times"] = step_delta(before, step_times(url))
        point["waited_idle_s"] = drained
        result["rates"].append(point)
        print(f"  {name} [{workload}]: {rate:g} req/s -> {point['attainment']:.0%} of {point['timed']} within SLO "
              f"(TTFT p90 "
              f"{(point['ttft_ms'] or {}).get('p90', 0):.0f} ms, TPOT p90 {(point['tpot_ms'] or {}).get('p90', 0):.1f}"
              f" ms, ITL p99 median {(point['itl_p99_ms'] or {}).get('median', 0):.1f} ms, second token p90 "
              f"{(point['second_token_ms'] or {}).get('p90', 0):.0f} ms, {point['abandoned']} "
              f"given up{busiest(point['step_times'])})", flush=True)
        return point["attainment"]

    rates_to_try(args, probe)
    for c in [int(c) for c in args.ttft_concurrency.split(",") if c]:
        rows, _ = _load(args, url, None, c, max(2 * c, 16), probe_seed(args.seed, workload, -c), workload=workload)
        result["ttft_under_load"][str(c)] = summary(r["ttft_ms"] for r in rows if "ttft_ms" in r)
    ok = [p["rate"] for p in result["rates"] if p["attainment"] >= args.attainment]
    result["goodput_rate"] = max(ok) if ok else 0.0
    return result


def measure_all(name: str, up_args: list[str], args) -> dict[str, dict]:
    """One ``pdserve up`` of this configuration, every workload of ``--workload`` against it in turn."""
    from deploy.local import Cluster

    cluster = Cluster(*up_args, ready_timeout=args.ready_timeout).wait_ready()
    try:
        _load(args, cluster.url, None, 2, 4, args.seed + 99)  # warm-up
        out = {}
        for workload in workloads_of(args):
            out[workload] = {**sweep(name, cluster.url, args, workload), "up_args": up_args}
        return out
    finally:
        cluster.stop()


def measure(name: str, up_args: list[str], args) -> dict:
    return next(iter(measure_all(name, up_args, args).values()))


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
    try:
        workloads = workloads_of(args)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return 2
    results = {w: [] for w in workloads}
    for name, up in configs:  # the reports are rewritten after each configuration: a cut-off run keeps its part
        for w, result in measure_all(name, up, args).items():
            results[w].append(result)
        for w in workloads:
            write(results[w], args, w, args.out if len(workloads) == 1 else f"{args.out}-{w}")
    return 0


def write(results: list[dict], args, workload: str, out: str) -> None:
    base = results[-1]["goodput_rate"]
    for r in results:
        r["vs_last"] = r["goodput_rate"] / base if base else None
    report = {"command": command_line("goodput"), "slo": {**slo_of(args), "attainment": args.attainment},
              "workload": {"kind": workload, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "requests_per_rate": args.requests, "duration_s": args.duration,
                           "warmup_requests": args.warmup_requests}, "results": results, "env": environment()}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = table(results, args)
    with open(out + ".md", "w") as f:
        f.write(f"`{report['command']}`\n\nworkload: {workload}\n\n{md}\n")
    plot(results, args, out + ".png")
    print(md)
    print("goodput ratios vs " + results[-1]["name"] + ": " + ", ".join(
        f"{r['name']} {r['vs_last']:.2f}x" if r["vs_last"] is not None else f"{r['name']} -" for r in results))
    print(f"wrote {out}.json, .md, .png", flush=True)
