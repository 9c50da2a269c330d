"""``pdserve bench chaos``: streams under load while workers are killed.

Starts ``pdserve up`` (``--up-args``, default ``--prefill 2 --decode 2``), keeps ``--streams`` streaming requests
going for ``--duration`` seconds and every ``--kill-every`` seconds SIGKILLs a random worker (one whose role has
another worker in the picks, so the cluster can always serve; while the last victim still restarts, it waits for
it); ``up`` restarts it. Each request ends as one of:

- ``ok``: all its tokens and ``[DONE]``;
- ``failed_before_first_byte``: an HTTP error, or an error event before any token (retries exist to make this 0;
  requests ask for token ids, so every token is a chunk, even one whose text is held back);
- ``failed_mid_stream``: an error event after tokens (a stream whose decode worker died goes on on another, from
  its last token: none should).

At the end it lets the cluster settle and reports, per worker, KV blocks free against the pool size at the start
and the end (and prefill's held bytes), the router's admission reservations and requests in flight (a leak leaves
them above 0), RSS growth after the warm-up of the router and of every worker that was never killed, latency
percentiles and the router's retries by reason."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shlex
import signal
import time

import httpx

from deploy.local import Cluster

from deploy.progress import bar
from .report import command_line
from .soak import process_name, rss_bytes
from planner.stats import summary

log = logging.getLogger(__name__)
WORKER_ROLES = ("prefill", "decode", "colocated")


def add_arguments(p):
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default: duration/5)")
    p.add_argument("--up-args", default="--prefill 2 --decode 2", help="arguments of the pdserve up it starts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=60.0, help="seconds to wait for the cluster to be idle and whole")
    p.add_argument("--out", default="bench/out/chaos")


def workers(health: dict) -> list[dict]:
    return [{**w, "role": role} for role in WORKER_ROLES for w in health.get("workers", {}).get(role, [])]


def clean(w: dict) -> bool:
    """No blocks in use and nothing held: what an idle worker looks like."""
    return w.get("healthy") and w.get("kv_blocks_free") == w.get("kv_blocks") and not w.get("kv_held_bytes") \
        and not w.get("active") and not w.get("waiting")


async def one_request(client, url, model, rng, max_tokens, out: dict) -> None:
    body = {"model": model, "prompt": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(8, 400))),
            "max_tokens": rng.randint(8, max_tokens), "temperature": rng.choice([0.0, 0.8]), "stream": True,
            "return_token_ids": True}  # a chunk for every token: text can be held back (a byte model's partial UTF-8)
    start, tokens, error, retries = time.perf_counter(), 0, None, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("message", "error")
                    elif chunk.get("choices"):
                        tokens += 1
                        retries = (chunk.get("pdserve") or {}).get("retries", retries)
    except httpx.HTTPError as e:
        error = repr(e)[:200]
    kind = "ok" if error is None else ("failed_mid_stream" if tokens else "failed_before_first_byte")
    out[kind] += 1
    out["retried"] += 1 if retries else 0
    if error is not None:
        out["samples"].setdefault(kind, []).append(error[:200])
    if kind == "ok":
        out["latency_ms"].append((time.perf_counter() - start) * 1e3)


async def stream_until(client, url, model, rng, stop_at, max_tokens, out):
    while time.monotonic() < stop_at:
        await one_request(client, url, model, rng, max_tokens, out)


async def kill_loop(client, url, every: float, stop_at: float, rng, kills: list, killed: set) -> None:
    start = time.monotonic()
    while time.monotonic() + every < stop_at:
        await asyncio.sleep(every)
        victims = await eligible(client, url)
        while not victims and time.monotonic() + every < stop_at:  # the last victim still restarting: wait for it
            await asyncio.sleep(0.5)
            victims = await eligible(client, url)
        if not victims:
            kills.append({"t": round(time.monotonic() - start, 1), "skipped": "no role had a second worker up"})
            continue
        victim = rng.choice(victims)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.add(victim["pid"])
        kills.append({"t": round(time.monotonic() - start, 1), "role": victim["role"], "pid": victim["pid"],
                      "address": victim["address"]})
        log.info("%.0fs: killed %s worker %s (pid %d)", kills[-1]["t"], victim["role"], victim["address"],
                 victim["pid"])


async def eligible(client, url) -> list[dict]:
    """Workers that may be killed: healthy, with another healthy worker of their role (the cluster keeps serving)."""
    ready = [w for w in workers((await client.get(url + "/health")).json()) if w.get("healthy") and w.get("pid")]
    return [w for w in ready if sum(1 for o in ready if o["role"] == w["role"]) >= 2]


async def settle(client, url, timeout: float) -> dict:
    """/health once every worker is back, idle and clean (or when ``timeout`` passes)."""
    end = time.monotonic() + timeout
    while True:
        health = (await client.get(url + "/health")).json()
        idle = health.get("admission", {}).get("in_flight") == 0
        if (idle and all(clean(w) for w in workers(health))) or time.monotonic() > end:
            return health
        await asyncio.sleep(0.5)


def retries_by_reason(metrics: str) -> dict:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("pdserve_request_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


async def chaos(url: str, args) -> dict:
    rng = random.Random(args.seed)
    out = {"ok": 0, "failed_before_first_byte": 0, "failed_mid_stream": 0, "retried": 0, "latency_ms": [],
           "samples": {}}
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        health = await settle(client, url, args.settle)
        before = {w["address"]: w for w in workers(health)}
        args.rss_pids = {"router": args.router_pid, **{a: w["pid"] for a, w in before.items()}}
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        start = time.monotonic()
        stop_at = start + args.duration
        warmup = args.warmup if args.warmup is not None else args.duration / 5
        kills, killed = [], set()
        tasks = [asyncio.create_task(stream_until(client, url, model, random.Random(args.seed + 1 + i), stop_at,
                                                  args.max_tokens, out)) for i in range(args.streams)]
        killer = asyncio.create_task(kill_loop(client, url, args.kill_every, stop_at, rng, kills, killed))
        baseline, progress = None, bar(round(args.duration), "chaos", "s")
        while not all(t.done() for t in tasks):
            await asyncio.sleep(2.0)
            now = time.monotonic() - start
            if baseline is None and now >= warmup:
                baseline = {k: rss_bytes(p) for k, p in args.rss_pids.items()}
            progress.update(min(round(now), progress.total) - progress.n)
            progress.set_postfix(ok=out["ok"], retried=out["retried"], before_first_byte=out["failed_before_first_byte"],
                                 mid_stream=out["failed_mid_stream"], kills=len(killed), refresh=False)
        progress.close()
        await asyncio.gather(*tasks)
        await killer
        final = {k: rss_bytes(p) for k, p in args.rss_pids.items()}
        health = await settle(client, url, args.settle)
        metrics = (await client.get(url + "/metrics")).text
    after = {w["address"]: w for w in workers(health)}
    baseline = baseline or final
    never_killed = [a for a, w in before.items() if w["pid"] not in killed]
    rss = {"router": growth(baseline.get("router"), final.get("router"))}
    rss.update({process_name(before[a]["pid"]): growth(baseline.get(a), final.get(a)) for a in never_killed
                if a in args.rss_pids})
    blocks = [{"role": w["role"], "address": a, "kv_blocks": w.get("kv_blocks"),
               "free_at_start": w.get("kv_blocks_free"), "free_at_end": after.get(a, {}).get("kv_blocks_free"),
               "held_bytes_at_end": after.get(a, {}).get("kv_held_bytes", 0),
               "healthy_at_end": bool(after.get(a, {}).get("healthy")), "restarts": after.get(a, {}).get("restarts")}
              for a, w in before.items()]
    latency = summary(out.pop("latency_ms"))
    return {"streams": args.streams, "duration_s": args.duration, "kill_every_s": args.kill_every,
            "up_args": args.up_args, **out, "requests": out["ok"] + out["failed_before_first_byte"]
            + out["failed_mid_stream"], "latency_ms": latency, "kills": kills,
            "retries_by_reason": retries_by_reason(metrics), "kv_blocks": blocks,
            "leaked_blocks": sum((b["kv_blocks"] or 0) - (b["free_at_end"] or 0) for b in blocks),
            "router_admission_at_end": health.get("admission"), "rss_growth_pct": rss, "warmup_s": warmup,
            "command": command_line("chaos")}


def growth(before: int | None, after: int | None) -> float | None:
    return 100.0 * (after - before) / before if before and after else None


def passed(report: dict) -> bool:
    growths = [g for g in report["rss_growth_pct"].values() if g is not None]
    admission = report["router_admission_at_end"] or {}
    return report["failed_before_first_byte"] == 0 and report["failed_mid_stream"] == 0 \
        and report["leaked_blocks"] == 0 \
        and not any(b["held_bytes_at_end"] for b in report["kv_blocks"]) \
        and all(b["healthy_at_end"] for b in report["kv_blocks"]) \
        and not admission.get("in_flight") and not admission.get("reserved") and max(growths, default=0.0) < 5.0


def write_report(report: dict, out: str) -> list[str]:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lat = report["latency_ms"]
    lines = [f"# Chaos: {report['streams']} streams for {report['duration_s']:.0f}s, a worker SIGKILLed every "
             f"{report['kill_every_s']:.0f}s (`pdserve up {report['up_args']}`)", "", f"`{report['command']}`", "",
             f"requests {report['requests']}: ok {report['ok']} (retried {report['retried']}), failed before the "
             f"first byte {report['failed_before_first_byte']}, failed mid-stream {report['failed_mid_stream']}; "
             f"kills {sum(1 for k in report['kills'] if 'pid' in k)}", "",
             f"latency of ok requests: p50 {lat.get('median', 0):.0f} ms, p99 {lat.get('p99', 0):.0f} ms", "",
             f"retries by reason: {report['retries_by_reason'] or 'none'}", "",
             f"router at the end: {report['router_admission_at_end']}; leaked KV blocks: {report['leaked_blocks']}",
             "", "| worker | kv blocks | free at start | free at end | restarts |", "|---|---|---|---|---|"]
    lines += [f"| {b['role']} {b['address']} | {b['kv_blocks']} | {b['free_at_start']} | {b['free_at_end']} | "
              f"{b['restarts']} |" for b in report["kv_blocks"]]
    lines += ["", "| process (never killed) | RSS growth after warm-up % |", "|---|---|"]
    lines += [f"| {name} | {g:+.2f} |" if g is not None else f"| {name} | n/a |"
              for name, g in report["rss_growth_pct"].items()]
    lines += ["", f"verdict: {'PASS' if passed(report) else 'FAIL'} (0 failed before the first byte or mid-stream, 0 leaked blocks, "
              "every worker back, RSS growth < 5%)"]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def run(args) -> int:
    cluster = Cluster(*shlex.split(args.up_args), ready_timeout=600).wait_ready()
    try:
        args.router_pid = router_pid(cluster.proc.pid)
        report = asyncio.run(chaos(cluster.url, args))
    finally:
        cluster.stop()
    print("\n".join(write_report(report, args.out)[4:]))
    return 0 if passed(report) else 1


def router_pid(up_pid: int) -> int | None:
    from deploy.local import children_of

    for pid in children_of(up_pid):
        if process_name(pid).startswith("router:"):
            return pid
    return None
