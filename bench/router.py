"""``pdserve bench router``: how many tokens per second one router process streams to clients.

A fake colocated worker (``bench.fake_worker``: the real control protocol, no model, tokens as fast as asked)
feeds one ``pdserve router`` process; ``--clients`` client processes each keep ``--streams`` streaming
completions open (``stream_options.include_usage``; raw HTTP/1.1 on asyncio sockets, counting the usage's
completion tokens, so a client costs little per token). Reported: tokens/s delivered, requests/s, the router
process's CPU seconds per token (its user + system time over the run, from /proc) as µs per token, and how
many SSE events carried those tokens (fewer than tokens when the router coalesced a lagging client's tokens).

    pdserve bench router [--clients 4] [--streams 32] [--max-tokens 256] [--duration 10]"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

from control.listen import listen, port_of

from .report import command_line


def add_arguments(p):
    p.add_argument("--clients", type=int, default=4, help="client processes")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams per client process")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load after a warm-up second")
    p.add_argument("--step-ms", type=float, default=0.0, help="the fake worker's step time (0: as fast as it can)")
    p.add_argument("--out", default="bench/out/router")


async def _stream(port: int, body: bytes) -> tuple[int, int]:
    """One streaming completion: ``(completion tokens, SSE events)``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    tail, events = b"", 0
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        events += chunk.count(b"data: ")
        tail = (tail + chunk)[-4096:]
    writer.close()
    at = tail.rfind(b'"completion_tokens":')
    if at < 0:
        raise RuntimeError(f"no usage in the stream's end: {tail[-300:]!r}")
    tokens = int(tail[at + 20:tail.index(b",", at)].strip().rstrip(b"}"))
    return tokens, events - 3  # the finish chunk, the usage chunk and [DONE] carry no token


async def _client_async(port: int, streams: int, max_tokens: int, until: float, start_at: float) -> dict:
    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    totals = {"tokens": 0, "events": 0, "requests": 0, "errors": 0, "error_samples": []}

    async def loop():
        while time.time() < until:
            try:
                tokens, events = await _stream(port, body)
            except Exception as e:  # noqa: BLE001 - counted, a few kept
                totals["errors"] += 1
                if len(totals["error_samples"]) < 3:
                    totals["error_samples"].append(f"{type(e).__name__}: {e}"[:300])
                await asyncio.sleep(0.05)
                continue
            if time.time() >= start_at:
                totals["tokens"] += tokens
                totals["events"] += events
                totals["requests"] += 1
    await asyncio.gather(*(loop() for _ in range(streams)))
    return totals


def _client(args) -> dict:
    return asyncio.run(_client_async(*args))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_fake_cluster(step_ms: float):
    """A fake colocated worker (``bench.fake_worker``) behind a ``pdserve router``, each on a listening socket bound
    here and handed over: ``(worker, router, router_port)`` once the router's /health is ok."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    worker_sock, router_sock = listen("127.0.0.1"), listen("127.0.0.1")
    worker_port, router_port = port_of(worker_sock), port_of(router_sock)
    worker = subprocess.Popen([sys.executable, "-m", "bench.fake_worker", "--control-fd", str(worker_sock.fileno()),
                               "--step-ms", str(step_ms)], env=env, pass_fds=[worker_sock.fileno()])
    router = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--listen-fd", str(router_sock.fileno()),
                               "--colocated", f"tcp://127.0.0.1:{worker_port}"], env=env, pass_fds=[router_sock.fileno()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker_sock.close()
    router_sock.close()
    import httpx

    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{router_port}/health", timeout=1).status_code == 200:
                return worker, router, router_port
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    worker.kill()
    router.kill()
    raise RuntimeError("the router did not become healthy with the fake worker")


def run(args) -> int:
    worker, router, router_port = start_fake_cluster(args.step_ms)
    try:
        start_at = time.time() + 1.0
        until = start_at + args.duration
        cpu0 = None
        with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
            pending = pool.map_async(_client, [(router_port, args.streams, args.max_tokens, until, start_at)] * args.clients)
            time.sleep(max(0.0, start_at - time.time()))
            cpu0, t0 = _cpu_seconds(router.pid), time.time()
            results = pending.get(timeout=args.duration + 120)
            cpu1, t1 = _cpu_seconds(router.pid), time.time()
    finally:
        for p in (router, worker):
            p.terminate()
        for p in (router, worker):
            p.wait(timeout=10)
    wall = min(t1, until) - t0
    totals = {k: sum(r[k] for r in results) for k in results[0] if k != "error_samples"}
    totals["error_samples"] = [e for r in results for e in r["error_samples"]][:5]
    report = {"command": command_line("router"), "clients": args.clients, "streams": args.streams * args.clients,
              "max_tokens": args.max_tokens, "seconds": wall, **totals,
              "tok_per_s": totals["tokens"] / wall, "requests_per_s": totals["requests"] / wall,
              "router_cpu_s": cpu1 - cpu0, "router_cpu_share": (cpu1 - cpu0) / (t1 - t0),
              "router_us_per_token": (cpu1 - cpu0) / max(1, totals["tokens"]) * 1e6,
              "tokens_per_event": totals["tokens"] / max(1, totals["events"]), "cpus": os.cpu_count()}
    _write(report, args.out)
    return 0 if totals["tokens"] else 1


def _write(report: dict, prefix: str) -> None:
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = (f"| streams | tok/s | req/s | router CPU µs/token | router CPU share | tokens per SSE event | errors |\n"
            f"|---|---|---|---|---|---|---|\n| {report['streams']} | {report['tok_per_s']:.0f} | "
            f"{report['requests_per_s']:.1f} | {report['router_us_per_token']:.1f} | {report['router_cpu_share']:.0%} | "
            f"{report['tokens_per_event']:.2f} | {report['errors']} |\n")
    with open(prefix + ".md", "w") as f:
        f.write(f"# One router process, fake worker ({report['cpus']} CPUs)\n\n`{report['command']}`\n\n{text}")
    print(text)
