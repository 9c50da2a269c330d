"""``pdserve bench soak``: many concurrent streams for a long time; reports
errors and the resident memory (RSS) growth of every cluster process.

By default it starts its own ``pdserve up`` (extra ``--up-args`` pass
through); ``--url`` with ``--pids`` soaks a running cluster instead. RSS is
sampled every few seconds; growth is measured from the end of the warm-up
(``--warmup``, default a fifth of the run) to the end."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import sys
import time

import httpx

from deploy.forked import argv_of
from deploy.local import Cluster, children_of

from deploy.progress import bar


def add_arguments(p):
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--duration", type=float, default=600.0, help="seconds")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default: duration/5)")
    p.add_argument("--url", default=None, help="soak this running endpoint instead of starting a cluster")
    p.add_argument("--pids", default="", help="with --url: comma-separated pids to watch")
    p.add_argument("--up-args", default="", help="extra arguments for the cluster it starts, e.g. '--transport shm'")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/soak")


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_name(pid: int) -> str:
    try:
        role = next((a for a in argv_of(pid) if a in ("router", "prefill", "decode")), "?")
        return f"{role}:{pid}"
    except OSError:
        return str(pid)


async def stream_forever(client, url, model, rng, stop_at, counts, max_tokens):
    while time.monotonic() < stop_at:
        body = {"model": model, "prompt": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(8, 400))),
                "max_tokens": rng.randint(8, max_tokens), "temperature": rng.choice([0.0, 0.8]), "stream": True}
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    counts["errors"] += 1
                    counts.setdefault("error_samples", []).append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        counts["errors"] += 1
                        counts.setdefault("error_samples", []).append(line[:200])
                counts["requests"] += 1
        except httpx.HTTPError as e:
            counts["errors"] += 1
            counts.setdefault("error_samples", []).append(repr(e)[:200])


async def soak(url: str, pids: list[int], args) -> dict:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.streams + 4)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        start = time.monotonic()
        stop_at = start + args.duration
        warmup = args.warmup if args.warmup is not None else args.duration / 5
        counts = {"requests": 0, "errors": 0}
        tasks = [asyncio.create_task(stream_forever(client, url, model, random.Random(args.seed + i), stop_at, counts,
                                                    args.max_tokens)) for i in range(args.streams)]
        samples, baseline = [], None
        progress = bar(round(args.duration), "soak", "s")
        while not all(t.done() for t in tasks):
            await asyncio.sleep(min(5.0, max(0.5, args.duration / 60)))
            now = time.monotonic() - start
            rss = {p: rss_bytes(p) for p in pids}
            samples.append({"t": round(now, 1), "rss": rss, "requests": counts["requests"], "errors": counts["errors"]})
            if baseline is None and now >= warmup:
                baseline = dict(rss)
            progress.update(min(round(now), progress.total) - progress.n)
            progress.set_postfix(requests=counts["requests"], errors=counts["errors"],
                                 rss_mib=round(sum(rss.values()) / 2**20), refresh=False)
        await asyncio.gather(*tasks)
        progress.close()
    final = {p: rss_bytes(p) for p in pids}
    baseline = baseline or samples[0]["rss"]
    growth = {process_name(p): 100.0 * (final[p] - baseline[p]) / baseline[p] for p in pids if baseline.get(p)}
    total0, total1 = sum(baseline.values()), sum(final.values())
    return {"streams": args.streams, "duration_s": args.duration, "warmup_s": warmup, "requests": counts["requests"],
            "errors": counts["errors"], "error_samples": counts.get("error_samples", [])[:10],
            "rss_growth_pct": growth, "rss_total_growth_pct": 100.0 * (total1 - total0) / total0 if total0 else 0.0,
            "rss_final_mib": {process_name(p): final[p] / 2**20 for p in pids}, "samples": samples,
            "command": " ".join(shlex.quote(a) for a in sys.argv)}


def run(args) -> int:
    cluster = None
    if args.url:
        url, pids = args.url, [int(p) for p in args.pids.split(",") if p]
    else:
        cluster = Cluster(*shlex.split(args.up_args)).wait_ready()
        url, pids = cluster.url, children_of(cluster.proc.pid)
    try:
        report = asyncio.run(soak(url, pids, args))
    finally:
        if cluster:
            cluster.stop()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Soak: {report['streams']} streams for {report['duration_s']:.0f}s", "", f"`{report['command']}`", "",
             f"requests {report['requests']}, errors {report['errors']}, "
             f"RSS growth after warm-up {report['rss_total_growth_pct']:+.2f}% in total", "",
             "| process | RSS MiB | growth % |", "|---|---|---|"]
    lines += [f"| {name} | {report['rss_final_mib'][name]:.0f} | {g:+.2f} |" for name, g in report["rss_growth_pct"].items()]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    return 0 if report["errors"] == 0 else 1
