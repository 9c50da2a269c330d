"""``pdserve bench migrate``: what moving decoding requests costs their streams.

One ``pdserve up`` (``--up-args``; it needs two decode workers or more), ``--streams`` greedy streams of
``--max-tokens`` tokens started together, twice: undisturbed, then with the decode worker holding the most drained
(``POST /admin/drain``) once every stream has ``--drain-after`` tokens. Per run: errors, whether each text equals the
undisturbed run's, the gaps between a stream's tokens (p50 / p99 / max over every stream; a gap an event of several
tokens closes counts once), and for the drained run each move's stall (from the source's last token to the target's
first, as the router's ``pdserve`` block reports it) and KV bytes.

    pdserve bench migrate --up-args "--decode 2 --model DIR" --streams 32 --max-tokens 256"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import threading
import time

import httpx

from deploy.local import Cluster

from .report import command_line


def add_arguments(p):
    p.add_argument("--up-args", default="--decode 2", help="pdserve up's arguments (two decode workers or more)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=8,
                   help="words of each prompt (the context a move carries; a byte tokenizer makes 4 tokens of each)")
    p.add_argument("--drain-after", type=int, default=8, help="tokens every stream has before the drain")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench/out/migrate")


class Stream(threading.Thread):
    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.text, self.tokens, self.gaps, self.error, self.pdserve = "", 0, [], None, None

    def run(self):
        last = None
        try:
            with httpx.Client(timeout=600) as client, client.stream("POST", self.url + "/v1/completions",
                                                                     json=self.body) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"].get("message")
                        continue
                    now = time.perf_counter()
                    for choice in chunk.get("choices") or []:
                        self.text += choice.get("text") or ""
                        self.tokens += len(choice.get("token_ids") or [])
                    self.pdserve = chunk.get("pdserve") or self.pdserve
                    if last is not None:
                        self.gaps.append((now - last) * 1e3)
                    last = now
        except httpx.HTTPError as e:
            self.error = repr(e)


def _busiest(url: str) -> dict:
    decode = httpx.get(url + "/health", timeout=10).json()["workers"].get("decode") or []
    if len(decode) < 2:
        raise SystemExit("bench migrate needs two decode workers or more (--up-args \"--decode 2 ...\")")
    return max(decode, key=lambda w: w["outstanding"])


def one_run(url: str, model: str, args, drain: bool) -> dict:
    filler = " ".join(["sea"] * max(0, args.prompt_words - 4))
    bodies = [{"model": model, "prompt": f"stream {i}: tell {filler}", "max_tokens": args.max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
              for i in range(args.streams)]
    streams = [Stream(url, b) for b in bodies]
    for s in streams:
        s.start()
    drained = None
    if drain:
        end = time.monotonic() + 120
        while any(s.tokens < args.drain_after and s.is_alive() for s in streams) and time.monotonic() < end:
            time.sleep(0.01)
        drained = _busiest(url)["address"]
        httpx.post(url + "/admin/drain", json={"worker": drained}, timeout=10).raise_for_status()
    for s in streams:
        s.join(600)
        if s.error is None and s.tokens != args.max_tokens:  # ignore_eos: every stream runs to max_tokens
            s.error = f"ended after {s.tokens} of {args.max_tokens} tokens"
    if drained:
        httpx.post(url + "/admin/undrain", json={"worker": drained}, timeout=10)
    gaps = sorted(g for s in streams for g in s.gaps)
    moves = [m for s in streams for m in ((s.pdserve or {}).get("migrations") or [])]
    return {"drained": drained, "errors": [s.error for s in streams if s.error],
            "tokens": [s.tokens for s in streams], "texts": [s.text for s in streams],
            "gap_ms": {"p50": _pct(gaps, 0.5), "p99": _pct(gaps, 0.99), "max": gaps[-1] if gaps else None},
            "moves": moves, "stall_ms": {"median": statistics.median([m["stall_ms"] for m in moves]) if moves else None,
                                         "max": max((m["stall_ms"] for m in moves), default=None)}}


def push_phases(url: str) -> dict:
    """The mean of each phase of the moves' KV pushes (ms), from the router's metrics (transport ``*-migration``)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums, counts = {}, {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples if family.name == "pdserve_kv_transfer_phase_seconds" else ():
            if sample.labels.get("transport", "").endswith("-migration") and sample.name.endswith(("_sum", "_count")):
                (sums if sample.name.endswith("_sum") else counts)[sample.labels["phase"]] = sample.value
    return {p: round(sums[p] / counts[p] * 1e3, 2) for p in sums if counts.get(p)}


def _pct(values: list, q: float):
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def run(args) -> int:
    cluster = Cluster(*shlex.split(args.up_args), ready_timeout=args.ready_timeout).wait_ready()
    try:
        model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        plain = one_run(cluster.url, model, args, drain=False)
        moved = one_run(cluster.url, model, args, drain=True)
        moved["push_phases_ms"] = push_phases(cluster.url)
    finally:
        cluster.stop()
    same = sum(a == b for a, b in zip(plain.pop("texts"), moved.pop("texts")))
    report = {"command": command_line("migrate"), "up_args": args.up_args, "streams": args.streams,
              "max_tokens": args.max_tokens, "undisturbed": plain, "drained": moved, "texts_equal": same}
    lines = [f"# Moving {args.streams} streams off a drained decode worker", "", f"`{report['command']}`", "",
             "| run | errors | texts equal | gap p50 ms | gap p99 ms | gap max ms | moves | stall median ms | stall max ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("undisturbed", plain), ("drained", moved)):
        g, st = r["gap_ms"], r["stall_ms"]
        lines.append(f"| {name} | {len(r['errors'])} | {same if name == 'drained' else '-'} | {_f(g['p50'])} | "
                     f"{_f(g['p99'])} | {_f(g['max'])} | {len(r['moves'])} | {_f(st['median'])} | {_f(st['max'])} |")
    if moved["push_phases_ms"]:
        lines += ["", "Each move's KV push, mean ms by phase: " +
                  ", ".join(f"{k} {v}" for k, v in moved["push_phases_ms"].items())]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0 if not plain["errors"] and not moved["errors"] and same == args.streams else 1


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"
