"""``pdserve bench replay TRACE``: a production trace replayed against pdserve.

TRACE is Mooncake's JSONL or Azure's 2023 CSV (``planner.traces``). The server is a running one (``--url``) or one
started here (``--up-args``, as the other benches do). Each request of the window (``--start``, ``--count``,
``--duration``) goes out at its arrival time divided by ``--speed``, at most ``--concurrency`` at once, its prompt as
token ids: every block id of the trace becomes ``--block-size`` tokens drawn from the served model's vocabulary by a
generator seeded with the id, so equal ids give equal tokens and the trace's prefix sharing survives (a partial last
block is the first tokens of its id's). Its output is forced to the trace's length (``min_tokens`` = ``max_tokens``,
``ignore_eos``). A prompt that does not fit ``--max-context`` (default: the workers' context) with its output is
clipped or skipped (``--too-long``), and counted.

The report: TTFT, TPOT and ITL percentiles, SLO attainment and goodput (``bench.serve.summarize``), and prompt tokens
reused three ways, side by side: the window's ideal (an unlimited cache), an LRU over blocks at the cluster's KV
capacity (``planner.reuse``; the prompt-computing workers' pools and host tiers, or ``--kv-capacity-blocks``), and
what the workers reported (their prefix counters' growth over the run, per worker and in total), and each worker's
steps over the run (``summary.workers``: decode-only and prompt steps, their mean ms, how busy it was). With
``--same-prompts`` the two models keep what the runs before sent, as the workers' caches do.
``--engine-alone`` then runs the first run's prompts through the engine alone (``bench.replay_engine``): the rate
serving is held against. ``--speeds`` replays the window at each speed, each with tokens of its own (no run reuses
another's cache; ``--same-prompts``: the first run's tokens every time), and names the fastest whose attainment
meets ``--attainment``. JSON, Markdown and a plot go to ``--out``."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import time

import httpx

from deploy.progress import bar
from planner.reuse import reused_tokens
from planner.traces import TRACE_BLOCK, TraceRequest, kind_of, read
from planner.workload import Request

from .report import command_line, plot_cdfs
from .health import settled_step_times, step_delta, with_busy
from .serve import one, summarize
from .transfer import environment

FIRST_TOKEN = 3  # ids below are special tokens in the byte tokenizer and many others (pad, bos, eos)


def add_arguments(p):
    p.add_argument("trace", help="a Mooncake JSONL or Azure CSV trace")
    p.add_argument("--url", default=None, help="a running pdserve router (else --up-args starts one)")
    p.add_argument("--up-args", default="", help="pdserve up arguments of a cluster started here")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--speed", type=float, default=1.0, help="a multiple of real time (2: arrivals twice as dense)")
    p.add_argument("--speeds", default=None, help="comma-separated speeds, each a run: the goodput search")
    p.add_argument("--attainment", type=float, default=0.9, help="--speeds: the share of requests within the SLOs")
    p.add_argument("--start", type=int, default=0, help="the window's first request")
    p.add_argument("--count", type=int, default=None, help="requests in the window")
    p.add_argument("--duration", type=float, default=None, help="seconds of the trace in the window")
    p.add_argument("--max-context", type=int, default=None, help="tokens a request may hold (default: the workers')")
    p.add_argument("--too-long", choices=("clip", "skip"), default="skip", help="a request over --max-context")
    p.add_argument("--block-size", type=int, default=TRACE_BLOCK, help=f"tokens a block id becomes (the traces' "
                   f"{TRACE_BLOCK}; smaller scales every length down by block-size/{TRACE_BLOCK}, said in the report)")
    p.add_argument("--trace-block", type=int, default=TRACE_BLOCK, help="tokens a block of the trace as recorded (a "
                   "trace written already scaled down says so here)")
    p.add_argument("--output-tokens", type=int, default=None, help="every request's output forced to this many "
                   "tokens (default: the trace's own)")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight at most")
    p.add_argument("--engine-alone", action="store_true", help="then the same prompts through one in-process engine "
                   "of --up-args' engine options, the cluster stopped (bench.replay_engine): serving's share of it")
    p.add_argument("--kv-capacity-blocks", type=int, default=None, help="the LRU column's blocks (default: the "
                   "prompt-computing workers' KV pools, in blocks of --block-size)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="the tokens' seed (with the run's index)")
    p.add_argument("--same-prompts", action="store_true", help="every run of --speeds sends the first run's tokens "
                   "(what a cache that outlives a run keeps shows in the later runs)")
    p.add_argument("--name", default=None, help="the configuration's name in the report (default: --up-args)")
    p.add_argument("--out", default="bench/out/replay", help="directory of the report")


def block_tokens(block: int, size: int, vocab: int, salt: str) -> list[int]:
    """The ``size`` tokens block id ``block`` stands for (the same for the same id and salt)."""
    rng = random.Random(f"{salt}:{block}")
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(size)]


class Prompts:
    """Token ids of trace requests, their blocks made once."""

    def __init__(self, block_size: int, vocab: int, salt: str):
        self.block_size, self.vocab, self.salt = block_size, vocab, salt
        self.blocks: dict[int, list[int]] = {}

    def ids(self, req: TraceRequest) -> list[int]:
        out: list[int] = []
        for block in req.blocks:
            if len(out) >= req.prompt_tokens:
                break
            if block not in self.blocks:
                self.blocks[block] = block_tokens(block, self.block_size, self.vocab, self.salt)
            out += self.blocks[block]
        return out[:req.prompt_tokens]


def fit(requests: list[TraceRequest], max_context: int, policy: str) -> tuple[list[TraceRequest], dict]:
    """The requests that fit ``max_context`` (prompt + output), those over it clipped or left out; the counts."""
    kept, counts = [], {"clipped": 0, "skipped": 0}
    for r in requests:
        if r.prompt_tokens + r.output_tokens <= max_context:
            kept.append(r)
        elif policy == "clip" and r.output_tokens < max_context:
            kept.append(TraceRequest(r.arrival_s, max_context - r.output_tokens, r.output_tokens, r.blocks))
            counts["clipped"] += 1
        else:
            counts["skipped"] += 1
    return kept, counts


def window(args, max_context: int) -> tuple[list[TraceRequest], dict]:
    """The window's requests that fit ``max_context``: with ``--too-long skip``, ``--count`` of those that fit (a
    skipped one counted only before the last kept), else ``--count`` from ``--start``; outputs as ``--output-tokens``."""
    skip = args.too_long == "skip"
    rows = read(args.trace, args.block_size, args.start, None if skip else args.count, args.duration, args.trace_block)
    if args.output_tokens is not None:
        rows = [TraceRequest(r.arrival_s, r.prompt_tokens, args.output_tokens, r.blocks) for r in rows]
    kept, counts = [], {"clipped": 0, "skipped": 0}
    for r in rows:
        if args.count is not None and len(kept) >= args.count:
            break
        fitted, c = fit([r], max_context, args.too_long)
        kept += fitted
        counts = {k: counts[k] + c[k] for k in counts}
    if not kept:
        raise ValueError(f"{args.trace}: no request of the window fits {max_context} tokens")
    first = kept[0].arrival_s
    return [TraceRequest(r.arrival_s - first, r.prompt_tokens, r.output_tokens, r.blocks) for r in kept], counts


def cluster(url: str) -> dict:
    """The workers /health lists, by address: role, context, vocabulary, KV pool and prefix counters."""
    health = httpx.get(url + "/health", timeout=10).json()
    out = {}
    for role, workers in (health.get("workers") or {}).items():
        for w in workers:
            if w.get("address") not in out:
                out[w["address"]] = {"role": role, **{k: w.get(k) for k in (
                    "max_len", "vocab_size", "kv_blocks", "kv_block_size", "prefix_prompt_tokens",
                    "prefix_cached_tokens", "host_capacity_blocks", "prefix_host_cached_tokens")}}
    if not out:
        raise RuntimeError(f"{url}/health lists no workers")
    return out


def capacity_blocks(workers: dict, block_size: int) -> int:
    """The prompt-computing workers' KV pools (prefill and colocated ones; else all), in blocks of ``block_size``."""
    computing = [w for w in workers.values() if w["role"] in ("prefill", "colocated")] or list(workers.values())
    return sum(((w["kv_blocks"] or 0) + (w.get("host_capacity_blocks") or 0)) * (w["kv_block_size"] or 0)
               for w in computing) // block_size


def reported(before: dict, after: dict) -> dict:
    """Each worker's prompt tokens and prefix-cached tokens over the run, and their total."""
    rows = {}
    for address, w in after.items():
        b = before.get(address, {})
        rows[address] = {"role": w["role"], **{k: (w.get(k) or 0) - (b.get(k) or 0)
                                                 for k in ("prefix_prompt_tokens", "prefix_cached_tokens")}}
    total = {k: sum(r[k] for r in rows.values()) for k in ("prefix_prompt_tokens", "prefix_cached_tokens")}
    return {"workers": rows, "total": total}


async def send(url: str, model: str, requests: list[TraceRequest], prompts: Prompts, speed: float,
               concurrency: int) -> tuple[list[dict], float]:
    """Every request at its arrival / ``speed``; the rows of ``bench.serve.one`` (with ``index``) and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    rows: list[dict] = []
    progress = bar(len(requests), "replay", "req")
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def fire(index: int, req: TraceRequest):
            await asyncio.sleep(max(0.0, start + req.arrival_s / speed - time.perf_counter()))
            async with gate:
                row = await one(client, url, model, "completions", Request(prompts.ids(req), req.output_tokens), 0.0,
                                extra={"min_tokens": req.output_tokens, "ignore_eos": True})
            row["index"], row["arrival_s"] = index, req.arrival_s / speed
            rows.append(row)
            progress.update()
        await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - start
    progress.close()
    return sorted(rows, key=lambda r: r["index"]), wall


def reuse_table(requests: list[TraceRequest], block_size: int, capacity: int, workers: dict,
                before: list[TraceRequest] = ()) -> dict:
    """Prompt tokens computed and reused: ideal, LRU at ``capacity`` blocks, and as the workers reported. ``before``:
    the requests earlier runs sent with the same tokens (their blocks are in the models' caches as in the workers')."""
    prompt = sum(r.prompt_tokens for r in requests)
    seen = [*before, *requests]
    ideal = sum(reused_tokens(seen, block_size)[len(before):])
    lru = sum(reused_tokens(seen, block_size, capacity)[len(before):])
    got = workers["total"]
    return {"prompt_tokens": prompt, "lru_capacity_blocks": capacity,
            "ideal": {"reused_tokens": ideal, "computed_tokens": prompt - ideal, "share": ideal / max(1, prompt)},
            "lru": {"reused_tokens": lru, "computed_tokens": prompt - lru, "share": lru / max(1, prompt)},
            "workers": {"reused_tokens": got["prefix_cached_tokens"],
                        "computed_tokens": got["prefix_prompt_tokens"] - got["prefix_cached_tokens"],
                        "share": got["prefix_cached_tokens"] / max(1, got["prefix_prompt_tokens"]),
                        "per_worker": workers["workers"]}}


def replay_once(args, url: str, model: str, requests: list[TraceRequest], speed: float, salt: str,
                capacity: int, vocab: int, before: list[TraceRequest] = ()) -> dict:
    counters, steps = cluster(url), settled_step_times(url)
    rows, wall = asyncio.run(send(url, model, requests, Prompts(args.block_size, vocab, salt), speed,
                                  args.concurrency))
    time.sleep(1.0)  # the workers' last counters reach /health with their next pong
    after = cluster(url)
    out = {"speed": speed, "summary": summarize(rows, wall, args.slo_ttft_ms, args.slo_tpot_ms),
           "reuse": reuse_table(requests, args.block_size, capacity, reported(counters, after), before),
           "samples": rows}
    out["summary"]["prompt_tok_per_s"] = sum(r.prompt_tokens for r in requests) / wall if wall else 0.0
    out["summary"]["workers"] = with_busy(step_delta(steps, settled_step_times(url)), wall)  # their steps meanwhile
    return out


def goodput_result(args, requests: list[TraceRequest], speed: float | None, runs: list[dict]) -> dict:
    """The goodput as ``bench goodput`` reports it, for ``pdserve plan --measured``: the request rate of the window
    at the fastest speed within the SLOs (its requests over its span, times the speed), under the trace's name; and
    each run's rate with its workers' step times (``rates``, which ``pdserve plan --calibrate`` reads)."""
    span = max(requests[-1].arrival_s, 1e-9) if len(requests) > 1 else 1.0
    return {"name": args.name or args.up_args or args.url, "up_args": shlex.split(args.up_args),
            "workload": os.path.basename(args.trace), "goodput_speed": speed,
            "goodput_rate": (speed or 0.0) * len(requests) / span,
            "rates": [{"rate": run["speed"] * len(requests) / span, "step_times": run["summary"].get("workers", {}),
                       "goodput_fraction": run["summary"]["goodput_fraction"]} for run in runs]}


def markdown(report: dict) -> str:
    w = report["window"]
    lines = [f"# Trace replay: {os.path.basename(report['trace'])} ({report['format']})", "",
             f"`{report['command']}`", "",
             f"{w['requests']} requests from #{w['start']} ({w['clipped']} clipped, {w['skipped']} skipped over "
             f"{w['max_context']} tokens), blocks of {w['block_size']} tokens"
             + (f" (the trace's {w['trace_block']} scaled: every length x {w['block_size']}/{w['trace_block']})"
                if w["block_size"] != w["trace_block"] else "") + f"; {w['prompt_tokens']} prompt tokens.", "",
             "| speed | requests/s | prompt tok/s | errors | TTFT p50 / p90 ms | TPOT p50 / p90 ms | ITL p99 ms | "
             "within SLO | reused: ideal | LRU | workers |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        s, r = run["summary"], run["reuse"]
        lines.append(f"| {run['speed']:g} | {s['request_per_s']:.2f} | {s['prompt_tok_per_s']:.0f} | {s['errors']} | "
                     f"{s['ttft_ms'].get('median', 0):.0f} / {s['ttft_ms'].get('p90', 0):.0f} | "
                     f"{s['tpot_ms'].get('median', 0):.1f} / {s['tpot_ms'].get('p90', 0):.1f} | "
                     f"{s['itl_ms'].get('p99', 0):.1f} | {s['goodput_fraction']:.0%} | {r['ideal']['share']:.1%} | "
                     f"{r['lru']['share']:.1%} | {r['workers']['share']:.1%} |")
    lines += ["", "Per worker (last run): " + ", ".join(
        f"{a} ({v['role']}) {v['prefix_cached_tokens']} of {v['prefix_prompt_tokens']}"
        for a, v in report["runs"][-1]["reuse"]["workers"]["per_worker"].items())]
    if report.get("engine_alone"):
        a = report["engine_alone"]
        lines += ["", f"The engine alone on the same prompts (concurrency {report['window'].get('concurrency')}): "
                  f"{a['seconds']:.1f} s, {a['prompt_tok_per_s']:.0f} prompt tok/s, {a['reused_tokens']} tokens "
                  f"reused; the first run served {a['served_share']:.0%} of that rate."]
    if report.get("goodput_speed") is not None:
        lines += ["", f"Fastest speed with {report['attainment']:.0%} within the SLOs: {report['goodput_speed']:g} "
                  f"({report['results'][0]['goodput_rate']:.2f} req/s)"]
    return "\n".join(lines) + "\n"


def write(report: dict, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "replay.json"), "markdown": os.path.join(out, "replay.md")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(report))
    series = {f"speed {run['speed']:g}": {"ttft": [r["ttft_ms"] for r in run["samples"] if "ttft_ms" in r],
                                          "tpot": [r["tpot_ms"] for r in run["samples"] if "tpot_ms" in r]}
              for run in report["runs"]}
    png = plot_cdfs(series, os.path.join(out, "replay.png"))
    if png:
        paths["png"] = png
    return paths


def run(args) -> int:
    if args.engine_alone and args.url:
        raise SystemExit("bench replay: --engine-alone builds the engine of --up-args (a cluster it starts), not --url")
    started = None
    if not args.url:
        from deploy.local import Cluster

        started = Cluster(*shlex.split(args.up_args), ready_timeout=args.ready_timeout).wait_ready()
        args.url = started.url
    try:
        url = args.url.rstrip("/")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        workers = cluster(url)
        max_context = args.max_context or min(w["max_len"] for w in workers.values() if w.get("max_len"))
        requests, counts = window(args, max_context)
        capacity = args.kv_capacity_blocks or capacity_blocks(workers, args.block_size)
        vocab = min(w["vocab_size"] for w in workers.values() if w.get("vocab_size"))
        speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else [args.speed]
        runs = [replay_once(args, url, model, requests, speed, f"{args.seed}:{0 if args.same_prompts else i}",
                            capacity, vocab, requests * i if args.same_prompts else [])
                for i, speed in enumerate(speeds)]
    finally:
        if started is not None:
            started.stop()
    alone = None
    if args.engine_alone:  # the GPU free again: the same prompts as the first run, no serving between
        from .replay_engine import run as engine_run

        alone = engine_run(args.up_args, requests, Prompts(args.block_size, vocab, f"{args.seed}:0").ids,
                           args.concurrency)
        alone["served_share"] = runs[0]["summary"]["prompt_tok_per_s"] / alone["prompt_tok_per_s"]
    report = {"command": command_line("replay"), "trace": args.trace, "format": kind_of(args.trace), "url": url,
              "model": model, "env": environment(), "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
              "window": {"start": args.start, "requests": len(requests), "block_size": args.block_size,
                         "trace_block": args.trace_block, "concurrency": args.concurrency,
                         "output_tokens": args.output_tokens,
                         "max_context": max_context, "prompt_tokens": sum(r.prompt_tokens for r in requests),
                         **counts},
              "attainment": args.attainment, "runs": runs, "engine_alone": alone}
    if args.speeds:
        meeting = [run["speed"] for run in runs if run["summary"]["goodput_fraction"] >= args.attainment]
        report["goodput_speed"] = max(meeting) if meeting else None
        report["results"] = [goodput_result(args, requests, report["goodput_speed"], runs)]
    paths = write(report, args.out)
    print(markdown(report))
    print("wrote " + ", ".join(paths.values()))
    return 0 if all(run["summary"]["errors"] == 0 for run in runs) else 1
