"""What a running cluster's router says through ``/health`` about its workers, for the benchmarks: whether
anything is still in flight (``wait_idle``), and each worker's step-time totals (``engine.step_budget.StepLog``:
decode-only and prompt steps, the gaps between steps under work) taken before and after a run (``step_delta``)."""
from __future__ import annotations

import json
import time
import urllib.request

def step_times(url: str) -> dict:
    """Each worker's step-time totals (``StepLog``) by role and address, from the router's /health."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            workers = json.loads(r.read()).get("workers", {})
    except (OSError, ValueError):
        return {}
    return {f"{role}:{w.get('address')}": {**w["step_times"], **{k: w[k] for k in CAP_KEYS if k in w}}
            for role, ws in workers.items() if isinstance(ws, list)
            for w in ws if isinstance(w, dict) and isinstance(w.get("step_times"), dict)}


def settled_step_times(url: str, limit_s: float = 3.0, every_s: float = 0.3) -> dict:
    """``step_times`` once two readings ``every_s`` apart agree (the router hears each worker's totals with its
    heartbeat, every 0.25 s by default: a reading right after a run may miss its last steps)."""
    now, end = step_times(url), time.monotonic() + limit_s
    while now and time.monotonic() < end:  # nothing at all: not a pdserve router (or no steps reported)
        time.sleep(every_s)
        now, before = step_times(url), now
        if now == before:
            break
    return now


CAP_KEYS = ("step_prefill_cap", "mixed_step_fixed_ms", "step_ms_per_prompt_token", "step_base_ms")  # step_budget's


BUSY_KEYS = ("outstanding", "active", "waiting", "queued", "pushing", "prefilling")


def wait_idle(url: str, limit_s: float = 120.0) -> float | None:
    """Seconds until no worker has anything in flight (what a rate before left: each rate starts from an idle
    cluster), or None if it stayed busy ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                workers = json.loads(r.read()).get("workers", {})
        except (OSError, ValueError):
            workers = None
        if workers is not None and not any(w.get(k) for ws in workers.values() if isinstance(ws, list)
                                           for w in ws if isinstance(w, dict) for k in BUSY_KEYS):
            return round(time.monotonic() - start, 2)
        time.sleep(0.5)
    return None


def step_delta(before: dict, after: dict) -> dict:
    """Per worker, during one rate: decode-only and prompt steps, their mean ms, the gaps between steps, the device
    time of a decode graph replay (``graph_ms``, where graphs were timed), and the prompt-token cap of steps that
    decode (``step_budget``) with its fit, where the worker has one."""
    out = {}
    for key, a in after.items():
        b = before.get(key, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in ("decode_steps", "decode_ms", "decode_rows", "decode_context",
                                                   "prompt_steps", "prompt_ms", "prompt_tokens", "gaps", "gap_ms",
                                                   "gaps_over_5ms", "graph_replays", "graph_ms")}
        if d["decode_steps"] or d["prompt_steps"]:
            out[key] = {"decode_steps": d["decode_steps"], "prompt_steps": d["prompt_steps"],
                        "decode_step_ms": round(d["decode_ms"] / max(1, d["decode_steps"]), 3),
                        "decode_rows_mean": round(d["decode_rows"] / max(1, d["decode_steps"]), 2),
                        "decode_context_mean": round(d["decode_context"] / max(1, d["decode_rows"])),
                        "prompt_step_ms": round(d["prompt_ms"] / max(1, d["prompt_steps"]), 3),
                        "prompt_step_tokens": round(d["prompt_tokens"] / max(1, d["prompt_steps"])),
                        "gap_ms": round(d["gap_ms"] / max(1, d["gaps"]), 3), "gaps_over_5ms": d["gaps_over_5ms"],
                        "busy_ms": round(d["decode_ms"] + d["prompt_ms"], 1),
                        **({"graph_ms": round(d["graph_ms"] / d["graph_replays"], 3)} if d["graph_replays"] else {}),
                        **{k: a[k] for k in CAP_KEYS if a.get(k) is not None}}  # the cap as the rate left it
    return out


def with_busy(steps: dict, wall_s: float) -> dict:
    """``steps`` (``step_delta``) with each worker's ``busy``: the fraction of ``wall_s`` its engine spent in steps."""
    for w in steps.values():
        w["busy"] = round(w["busy_ms"] / (wall_s * 1e3), 3) if wall_s > 0 else 0.0
    return steps


def worker_lines(steps: dict) -> list[str]:
    """A line per worker: how busy its engine was, its prompt steps and its decode steps."""
    lines = []
    for key, w in steps.items():
        parts = [f"busy {w['busy']:.0%}"] if "busy" in w else []
        if w["prompt_steps"]:
            parts.append(f"{w['prompt_steps']} prompt steps of {w.get('prompt_step_tokens', 0)} tokens at "
                         f"{w['prompt_step_ms']:.1f} ms")
        if w["decode_steps"]:
            replay = f" (replay {w['graph_ms']:.1f})" if "graph_ms" in w else ""
            parts.append(f"{w['decode_steps']} decode steps of {w['decode_rows_mean']:.1f} rows at "
                         f"{w['decode_step_ms']:.2f} ms{replay}")
        lines.append(f"{key}: " + ", ".join(parts) + f", gaps {w['gap_ms']:.1f} ms")
    return lines


def busiest(steps: dict) -> str:
    """The worker with the slowest decode-only steps: its step and gap means."""
    if not steps:
        return ""
    key, w = max(steps.items(), key=lambda kv: kv[1]["decode_step_ms"])
    graph = f" (replay {w['graph_ms']:.1f} ms on the device)" if "graph_ms" in w else ""
    return (f"; slowest decode steps {w['decode_step_ms']:.1f} ms{graph} at {w['decode_rows_mean']:.0f} rows of "
            f"{w.get('decode_context_mean', 0):.0f} tokens, gaps "
            f"{w['gap_ms']:.1f} ms, {w['prompt_steps']} with prompt tokens ({key.split(':')[0]})")


def main(argv=None) -> int:
    """``python -m bench.health URL FILE``: the workers' step-time totals saved to FILE; with ``--since``, each
    worker's steps since FILE was saved (``step_delta``: step and replay ms, rows, context) printed as JSON and a
    line a worker."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.health")
    ap.add_argument("url")
    ap.add_argument("file")
    ap.add_argument("--since", action="store_true", help="print the steps since FILE was saved, not save")
    args = ap.parse_args(argv)
    now = settled_step_times(args.url.rstrip("/"))
    if not args.since:
        with open(args.file, "w") as f:
            json.dump(now, f)
        return 0
    with open(args.file) as f:
        steps = step_delta(json.load(f), now)
    print(json.dumps(steps, indent=1))
    print("\n".join(worker_lines(steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
