"""The plan set against goodput measured on the hardware (``pdserve plan --measured REPORT.json``).

A ``bench goodput`` report (or a ``bench replay --speeds`` one, its results
under the trace's name) names each configuration by its ``pdserve up``
arguments; a candidate of the plan, by the ``pdserve up`` it prints. Both
reduce to the same shape (``shape_of``: colocated or not, prefill and decode
workers, the TP of each, ``--disagg``, whether steps are capped by a TPOT
SLO), so predictions and measurements pair up whatever the names. The plan's
pick is judged as issue 32 asks: its measured goodput against the best
measured (``pick_vs_best``)."""
from __future__ import annotations

import json
import shlex


def _value(args: list[str], flag: str, default=None):
    """The last value given to ``flag`` in ``args``."""
    out = default
    for i, a in enumerate(args[:-1]):
        if a == flag:
            out = args[i + 1]
    return out


def shape_of(args: list[str]) -> tuple:
    """What a ``pdserve up`` runs, from its arguments: (colocated, prefill workers, decode workers, prefill TP,
    decode TP, disagg, capped, auto's prefill wait)."""
    tp = int(_value(args, "--tp", 1))
    colocated = "--colocated" in args
    prefill = 0 if colocated else int(_value(args, "--prefill", 1))
    capped = colocated and _value(args, "--slo-tpot-ms") is not None
    disagg = _value(args, "--disagg", "always")
    wait = float(_value(args, "--disagg-prefill-wait-ms", 500)) if disagg == "auto" else None
    return (colocated, prefill, int(_value(args, "--decode", 1)), int(_value(args, "--prefill-tp", tp)),
            int(_value(args, "--decode-tp", tp)), disagg, capped, wait)


def measured_goodputs(paths: list[str], workload: str | None = None) -> dict[tuple, dict]:
    """Shape -> {name, goodput, report} from ``bench goodput`` reports, of ``workload``'s results only when given.
    Where several reports measured a shape, the highest goodput stands: each is a rate the shape served within the
    SLO, and a run of finer rates above it that met none (goodput 0) does not undo it."""
    out = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for result in report["results"]:
            if workload is not None and result.get("workload", report.get("workload")) != workload:
                continue
            shape = shape_of(list(result["up_args"]))
            if shape not in out or result["goodput_rate"] > out[shape]["goodput"]:
                out[shape] = {"name": result["name"], "goodput": result["goodput_rate"], "report": path}
    return out


def compare(ranked: list[dict], measured: dict[tuple, dict]) -> dict:
    """``ranked``: the plan's candidates, best first ({name, goodput, up}). Each with its measurement (if any), and
    the pick's measured goodput over the best measured (None when the pick was not measured)."""
    rows = []
    for cand in ranked:
        m = measured.get(shape_of(shlex.split(cand["up"])[2:]))
        rows.append({"name": cand["name"], "predicted": cand["goodput"], "measured": m["goodput"] if m else None,
                     "measured_as": m["name"] if m else None})
    done = [r for r in rows if r["measured"] is not None]
    best = max(done, key=lambda r: r["measured"], default=None)
    pick = rows[0]["measured"] if rows else None
    ratio = pick / best["measured"] if pick is not None and best and best["measured"] else None
    return {"rows": rows, "best_measured": best["name"] if best else None, "pick_vs_best": ratio}


def table(result: dict) -> str:
    lines = ["| configuration | predicted (req/s) | measured (req/s) |", "|---|---|---|"]
    for r in result["rows"]:
        got = "-" if r["measured"] is None else f"{r['measured']:g} ({r['measured_as']})"
        lines.append(f"| {r['name']} | {r['predicted']:.2f} | {got} |")
    ratio = result["pick_vs_best"]
    verdict = "the pick was not measured" if ratio is None else \
        f"the pick's measured goodput is {ratio:.0%} of the best measured ({result['best_measured']})"
    return "\n".join(lines) + f"\n\n{verdict}"
