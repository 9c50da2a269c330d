"""The planner's decode steps fitted to serving's (``pdserve plan --calibrate --measured REPORT.json``).

A ``bench goodput`` report holds, for every rate and worker, what its
decode-only steps took under load (``step_times``: steps, mean ms, mean rows
and, from 2026-11-26 (8a9f8a5) on, the rows' mean context). Against the profile's step
of the same rows at its shortest context, the extra time is the K/V the
longer contexts read; the bytes over that time, summed over every point,
give the rate serving's decode steps read K/V at (per GPU), the profile's
``kv_read_gb_s``. A report without the context gets it from its workload:
the mean context of a decoding row, each request weighted by the steps it
decodes (its prompt plus half its output). Fitted on the workload planned
(the rate differs by workload: on 4x H200, Mistral-7B shape, the mixed
workload's steps read at about 2.1 TB/s, the long one's at about 4), it is
what turns two measured configurations into predictions for the others.
Prefill workers' prompt steps (their mean tokens and milliseconds at each
rate) set ``prefill_scale`` the same way: serving's steps over the
profile's of as many tokens."""
from __future__ import annotations

import json

from .workload import lengths
from .measured import shape_of
from .profile import Profile

MIN_STEPS = 50  # points of fewer decode-only steps are noise
MIN_PROMPT_STEPS = 10  # a prefill worker's prompt steps at a rate, fewer are noise


def row_context(workload: str, requests: int = 4000, seed: int = 0) -> float:
    """Mean tokens a decoding row attends to under ``workload``: prompt + half the output, weighted by output."""
    work = lengths(requests, "1000:4000", "128:512", seed, workload)
    return sum((p + o / 2) * o for p, o in work) / sum(o for _, o in work)


def _rates(paths: list[str], workload: str | None = None):
    """``(shape, workload, rate)`` for every rate of the reports at ``paths`` (of ``workload``'s results only, when
    given): ``shape`` as ``measured.shape_of`` reads the configuration's ``pdserve up`` arguments."""
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for result in report["results"]:
            kind = result.get("workload", report.get("workload", "uniform"))
            if workload is None or kind == workload:
                shape = shape_of(list(result["up_args"]))
                for rate in result["rates"]:
                    yield shape, kind, rate


def points(paths: list[str], workload: str | None = None) -> list[dict]:
    """Every worker's decode-only steps at every rate (of ``workload``'s results only, when given): {rows, context,
    ms, steps, tp, colocated}."""
    out, fallback = [], {}
    for (colocated, _, _, _, decode_tp, *_), kind, rate in _rates(paths, workload):
        for key, w in (rate.get("step_times") or {}).items():
            if not key.startswith(("decode:", "colocated:")) or w.get("decode_steps", 0) < MIN_STEPS:
                continue
            context = w.get("decode_context_mean")
            if not context:
                if kind not in fallback:
                    fallback[kind] = row_context(kind)
                context = fallback[kind]
            out.append({"rows": w["decode_rows_mean"], "context": context, "ms": w["decode_step_ms"],
                        "steps": w["decode_steps"], "tp": decode_tp, "colocated": colocated})
    return out


def handoff_steps(paths: list[str], workload: str | None = None) -> float | None:
    """Decode steps between a KV's arrival and its first decode, beyond the step itself: per rate of every plain
    P/D configuration (``--disagg always``), the second token's p50 less the transfer's phases (p50) and one decode
    step, over the decode step; the median of those (None without such a rate)."""
    found = []
    for (colocated, _, _, _, _, disagg, *_), _, rate in _rates(paths, workload):
        if colocated or disagg != "always":
            continue
        steps = [w["decode_step_ms"] for k, w in (rate.get("step_times") or {}).items()
                 if k.startswith("decode:") and w.get("decode_steps", 0) >= MIN_STEPS]
        second, phases = rate.get("second_token_ms") or {}, rate.get("pdserve_ms") or {}
        if not steps or "median" not in second:
            continue
        step = sum(steps) / len(steps)
        moved = sum((phases.get(p) or {}).get("median", 0.0) for p in ("serialize", "wire", "deserialize"))
        found.append(max(0.0, (second["median"] - moved - step) / step))
    return sorted(found)[len(found) // 2] if found else None


def kv_read_gb_s(profiles: dict[int, Profile], measured: list[dict]) -> float | None:
    """Per-GPU K/V read rate (GB/s) that explains the measured steps' time beyond the profile's at its shortest
    context; None when no point has such time (or none matches a profile's TP)."""
    gigabytes, seconds = 0.0, 0.0
    for p in measured:
        prof = profiles.get(p["tp"])
        if prof is None or p["rows"] <= 0:
            continue
        shortest = prof.shortest_context()
        extra_ms = p["ms"] - prof.measured_decode_ms(p["rows"], shortest)
        nbytes = p["rows"] * max(0.0, p["context"] - shortest) * prof.kv_bytes_per_token / p["tp"]
        if extra_ms > 0 and nbytes > 0:
            weight = p["steps"]
            gigabytes += weight * nbytes / 1e9
            seconds += weight * extra_ms / 1e3
    return gigabytes / seconds if seconds > 0 else None


def prefill_points(paths: list[str], workload: str | None = None) -> list[dict]:
    """Every prefill worker's prompt steps at every rate (of ``workload``'s results only, when given): {tokens, ms,
    steps, tp}: the mean prompt tokens and milliseconds of its steps (reports from 2026-11-26 (b80ba3d) on: earlier prefill
    workers did not report their steps)."""
    out = []
    for (_, _, _, prefill_tp, *_), _, rate in _rates(paths, workload):
        for key, w in (rate.get("step_times") or {}).items():
            enough = w.get("prompt_steps", 0) >= MIN_PROMPT_STEPS and w.get("prompt_step_tokens")
            if key.startswith("prefill:") and enough:
                out.append({"tokens": w["prompt_step_tokens"], "ms": w["prompt_step_ms"], "steps": w["prompt_steps"],
                            "tp": prefill_tp})
    return out


def prefill_scale(profiles: dict[int, Profile], measured: list[dict]) -> float | None:
    """Serving's prompt steps over the profile's steps of as many tokens, weighted by steps (None without a point
    whose TP has a profile)."""
    served, profiled = 0.0, 0.0
    for p in measured:
        prof = profiles.get(p["tp"])
        if prof is not None:
            served += p["steps"] * p["ms"]
            profiled += p["steps"] * prof.prefill_ms(int(p["tokens"])) / prof.prefill_scale
    return served / profiled if profiled > 0 else None
