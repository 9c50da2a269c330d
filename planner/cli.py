"""``pdserve plan``: which configuration of these GPUs serves this workload best.

    pdserve bench engine --profile ... --out prof-tp1     # on the hardware: writes prof-tp1.json
    pdserve plan --profile prof-tp1.json --gpus 2 --workload mixed --slo-ttft-ms 2000 --slo-tpot-ms 10
    pdserve plan placement --nodes studio1:128,studio2:128,macbook:36 --model minimax-m2-230b --bits 5 \
        --max-model-len 200000                            # pipeline stages: ``placement_cli``

Prints every candidate (``search``) with its predicted goodput, the best one
and its ``pdserve up`` command. ``--validate K`` then starts the best K with
``pdserve up`` here and measures them with ``bench goodput`` at rates around
the prediction, and prints predicted vs measured."""
from __future__ import annotations

import functools
import json
import os
import sys

from .workload import SHIFT_S, WORKLOADS, lengths
from .profile import Profile
from .search import SLO, Horizon, candidates, predict_at, rank
from .traces import TraceWindow, kind_of, read


SHIFTING_TOP_RATE = 50  # req/s: the highest rate simulated for ``shifting`` (its horizon's requests)


def shifting_at(count: int, rate: float, seed: int = 0) -> list[tuple[int, int]]:
    """``shifting``'s lengths at ``rate``: each phase is ``SHIFT_S`` seconds of arrivals, as ``bench goodput`` sends."""
    return lengths(count, "1", "1", seed, "shifting", rate=rate)


def add_arguments(p):
    p.add_argument("--profile", action="append", default=[],
                   help="a profile JSON from `pdserve bench engine --profile` (repeatable: one per TP degree)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to plan for")
    p.add_argument("--workload", choices=WORKLOADS, default="uniform")
    p.add_argument("--prompt-len", default="1000:4000", help="uniform: prompt tokens LO:HI")
    p.add_argument("--max-tokens", default="128:512", help="uniform: output tokens LO:HI")
    p.add_argument("--trace", default=None, help="instead: a production trace (Mooncake JSONL, Azure CSV) or JSONL rows "
                   "of {prompt_tokens, output_tokens}")
    p.add_argument("--requests", type=int, default=300, help="distinct request lengths drawn from the workload")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals simulated per rate (shifting: at least one phase of each kind)")
    p.add_argument("--max-requests", type=int, default=2000, help="at most this many simulated requests per rate")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    p.add_argument("--slo-stall-ms", type=float, default=None, help="longest gap between two tokens")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--link-gb-s", type=float, default=100.0, help="KV transfer bandwidth between GPUs (GB/s); "
                   "`pdserve bench transfer` measures it")
    p.add_argument("--local-tokens", type=int, default=512, help="--disagg auto: prompts prefilled on decode")
    p.add_argument("--prefill-waits", default="500", help="--disagg auto: the --disagg-prefill-wait-ms values to "
                   "plan, comma-separated (each its own candidate; lower ones prefill more on decode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at-rate", type=float, default=None, help="also print each candidate's predicted attainment "
                   "and TTFT/TPOT/stall quantiles at this rate (req/s), to set against a bench serve run")
    p.add_argument("--validate", type=int, default=0, help="measure the best K candidates with bench goodput")
    p.add_argument("--up-args", default="", help="--validate: arguments every pdserve up gets (e.g. --load-format "
                   "dummy --dtype bfloat16)")
    p.add_argument("--validate-requests", type=int, default=60)
    p.add_argument("--measured", action="append", default=[], help="a bench goodput report (repeatable): each "
                   "candidate beside its measured goodput, and the pick's against the best measured")
    p.add_argument("--calibrate", action="store_true", help="with --measured: fit the decode steps' K/V read rate to "
                   "the measured reports' serving steps of this workload (``calibrate``) before predicting")
    p.add_argument("--kv-read-gb-s", type=float, default=None, help="decode steps read K/V at this rate per GPU "
                   "(GB/s) at least (the profile's own steps alone otherwise)")
    p.add_argument("--save-profile", default=None, help="write the profile as calibrated (with --calibrate or "
                   "--kv-read-gb-s): what `pdserve up --roles auto --roles-profile` then plans on")
    p.add_argument("--tier-gb", default=None, help="with --trace: instead, what KV tiers of these sizes (GB a worker, "
                   "comma-separated, e.g. 0,500,1000,2000) buy on the trace: reuse and prompt times (planner.tiers)")
    p.add_argument("--tier-gb-s", type=float, default=50.0, help="--tier-gb: the tier's read rate into the GPU (GB/s)")
    p.add_argument("--out", default="bench/out/plan")
    kinds = p.add_subparsers(dest="plan_kind")
    from . import placement_cli

    placement_cli.add_arguments(kinds.add_parser("placement", help="layers per node of a pipeline, each fitting "
                                                 "its weights and the KV of the whole context"))


def load_profiles(paths: list[str]) -> dict[int, Profile]:
    profiles: dict[int, Profile] = {}
    for path in paths:
        prof = Profile.load(path)
        if prof.tp in profiles:
            raise ValueError(f"two profiles for tp={prof.tp}: give one per TP degree")
        profiles[prof.tp] = prof
    if len({p.model for p in profiles.values()}) > 1:
        raise ValueError("the profiles are of different models")
    return profiles


def table(ranked, slo: SLO, gpu: bool, top: float) -> str:
    """``top``: the highest rate simulated (a goodput there is a lower bound)."""
    rows = ["| configuration | GPUs | predicted goodput (req/s) | pdserve up |", "|---|---|---|---|"]
    for c in ranked:
        rate = f"{c.goodput:.2f}" + (" (or more)" if c.goodput >= top - 1e-9 else "")
        rows.append(f"| {c.name} | {c.gpus} | {rate} | `{c.up_command('MODEL', slo, gpu)}` |")
    return "\n".join(rows)


def read_rate(args, profiles: dict) -> dict | str | None:
    """Sets every profile's ``kv_read_gb_s`` from ``--kv-read-gb-s`` or ``--calibrate`` (which fits ``handoff_steps`` too); what was set (an error
    message when it cannot be)."""
    rate, source = args.kv_read_gb_s, "--kv-read-gb-s"
    if args.calibrate:
        from . import calibrate

        if not args.measured:
            return "--calibrate needs --measured REPORT.json (a bench goodput report with step times)"
        found = calibrate.points(args.measured, args.workload) or calibrate.points(args.measured)
        rate, source = calibrate.kv_read_gb_s(profiles, found), f"{len(found)} measured step points"
        if rate is None:
            return "--calibrate: the reports hold no decode steps slower than the profile's (nothing to fit)"
    if rate is None:
        return None
    handoff = calibrate.handoff_steps(args.measured, args.workload) if args.calibrate else None
    scale = None
    if args.calibrate:
        found = calibrate.prefill_points(args.measured, args.workload) or calibrate.prefill_points(args.measured)
        scale = calibrate.prefill_scale(profiles, found)
    for prof in profiles.values():
        prof.kv_read_gb_s = rate
        prof.handoff_steps = handoff or 0.0
        prof.prefill_scale = scale or 1.0
    print(f"decode steps read K/V at {rate:,.0f} GB/s per GPU at least ({source})"
          + (f"; a received KV waits {handoff:.1f} decode steps before its first" if handoff else "")
          + (f"; prompt steps take {scale:.2f}x the profile's" if scale else ""))
    return {"kv_read_gb_s": rate, "source": source, "handoff_steps": handoff, "prefill_scale": scale}


def tiers_run(args) -> int:
    from . import tiers
    from .traces import TRACE_BLOCK, read

    if not args.trace or len(args.profile) != 1:
        print("error: --tier-gb needs --trace and one --profile")
        return 2
    try:
        requests, profile = read(args.trace), Profile.load(args.profile[0])
        rows = tiers.tier_rows(requests, profile, [float(x) for x in args.tier_gb.split(",")], TRACE_BLOCK,
                               args.tier_gb_s)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    md = tiers.table(rows, TRACE_BLOCK)
    print(md)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"trace": args.trace, "profile": args.profile[0], "tier_gb_s": args.tier_gb_s, "rows": rows}, f,
                  indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"KV tiers on `{os.path.basename(args.trace)}`, profile `{args.profile[0]}`\n\n{md}\n")
    return 0


def run(args, validate=None) -> int:
    """``validate(best, args, model, slo, gpu)``: measures the best candidates (``bench.plan_validate``, given by
    the ``pdserve`` command: the planner runs no benchmark itself)."""
    if getattr(args, "plan_kind", None) == "placement":
        from . import placement_cli

        return placement_cli.run(args)
    if args.tier_gb:
        return tiers_run(args)
    if not args.profile or not args.gpus:
        print("error: pdserve plan needs --profile and --gpus (or: pdserve plan placement ...)")
        return 2
    try:
        profiles = load_profiles(args.profile)
        work = lengths(args.requests, args.prompt_len, args.max_tokens, args.seed, args.workload, args.trace)
        if args.trace and kind_of(args.trace):  # a production trace: its first --duration seconds, timed as recorded
            work = TraceWindow(tuple(read(args.trace, duration=args.duration)))
        if args.workload == "shifting" and not args.trace:  # phases of SHIFT_S seconds at each rate, both simulated
            work = functools.partial(shifting_at, seed=args.seed)
            args.duration = max(args.duration, 2 * SHIFT_S)
            args.max_requests = max(args.max_requests, int(SHIFTING_TOP_RATE * args.duration))
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    calibration = read_rate(args, profiles)
    if isinstance(calibration, str):
        print(f"error: {calibration}")
        return 2
    if args.save_profile:
        if len(profiles) != 1:
            print("error: --save-profile writes one profile; give one (a single TP degree)")
            return 2
        next(iter(profiles.values())).save(args.save_profile)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_stall_ms, args.attainment)
    cands = candidates(args.gpus, profiles, slo, tuple(float(w) for w in args.prefill_waits.split(",")))
    if not cands:
        print(f"error: no configuration of {args.gpus} GPUs with the TP degrees profiled ({sorted(profiles)})")
        return 2
    ranked = rank(cands, profiles, work, slo, args.link_gb_s, args.local_tokens, args.seed,
                  Horizon(args.duration, args.max_requests))
    model = next(iter(profiles.values())).model
    gpu = not next(iter(profiles.values())).device.startswith("cpu")
    best = ranked[0]
    report = {"command": " ".join(["pdserve", "plan", *sys.argv[sys.argv.index("plan") + 1:]])
              if "plan" in sys.argv else "pdserve plan", "gpus": args.gpus, "model": model, "slo": vars(slo),
              "workload": {"kind": "trace" if args.trace else args.workload, "prompt_len": args.prompt_len,
                           "max_tokens": args.max_tokens, "requests": args.requests},
              "candidates": [{"name": c.name, "goodput": c.goodput, "up": c.up_command(model, slo, gpu)} for c in ranked],
              "recommended": best.name, "calibration": calibration}
    md = table(ranked, slo, gpu, args.max_requests / args.duration)
    print(md)
    print(f"\nrecommended: {best.name} ({best.goodput:.2f} req/s predicted)\n  {best.up_command(model, slo, gpu)}")
    if args.at_rate:
        horizon = Horizon(args.duration, args.max_requests)
        report["at_rate"] = {c.name: predict_at(c, profiles, work, slo, args.link_gb_s, args.local_tokens,
                                                args.at_rate, args.seed, horizon) for c in ranked}
        for name, p in report["at_rate"].items():
            print(f"  at {args.at_rate:g} req/s, {name}: {p['attainment']:.0%} within SLO; TTFT p50/p90 "
                  f"{p['ttft_ms']['median']:.0f}/{p['ttft_ms']['p90']:.0f} ms, TPOT p50/p90 "
                  f"{p['tpot_ms']['median']:.1f}/{p['tpot_ms']['p90']:.1f} ms, stall p50 {p['stall_ms']['median']:.0f} ms")
    if args.validate and validate is None:
        print("error: --validate needs the pdserve command (it runs bench goodput)")
        return 2
    if args.validate:
        report["validation"] = validate(ranked[:args.validate], args, model, slo, gpu)
        top = max(report["validation"], key=lambda v: v["measured"])
        report["picked_vs_best_measured"] = (report["validation"][0]["measured"] / top["measured"]
                                             if top["measured"] else None)
    if args.measured:
        from . import measured

        of = os.path.basename(args.trace) if args.trace else args.workload  # a replay's results name their trace
        report["measured"] = measured.compare(report["candidates"], measured.measured_goodputs(args.measured, of))
        md += "\n\nAgainst the measurements (" + ", ".join(args.measured) + "):\n\n" + measured.table(report["measured"])
        print("\n" + measured.table(report["measured"]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"`{report['command']}`\n\n{md}\n\nRecommended: **{best.name}**: `{best.up_command(model, slo, gpu)}`\n")
    print(f"wrote {args.out}.json, .md")
    return 0
