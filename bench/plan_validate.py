"""``pdserve plan --validate K``: the best K candidates of the planner started with ``pdserve up`` here and measured
with ``bench goodput`` at rates around each prediction (predicted against measured goodput)."""
from __future__ import annotations

import argparse
import shlex

from planner.search import SLO

from . import goodput as gp


def validate(best, args, model: str, slo: SLO, gpu: bool) -> list[dict]:
    out = []
    for c in best:
        rates = ",".join(f"{c.goodput * f:.3g}" for f in (0.5, 0.8, 1.0, 1.25) if c.goodput * f > 0) or "0.1"
        ns = argparse.Namespace(rates=rates, requests=args.validate_requests, prompt_len=args.prompt_len,
                                max_tokens=args.max_tokens, workload=args.workload, slo_ttft_ms=slo.ttft_ms,
                                slo_tpot_ms=slo.tpot_ms, slo_stall_ms=slo.stall_ms, attainment=slo.attainment,
                                ttft_concurrency="", ready_timeout=600.0, seed=args.seed, warmup_requests=4)
        up = shlex.split(c.up_command(model, slo, gpu))[2:] + shlex.split(args.up_args)
        measured = gp.measure(c.name, up, ns)
        out.append({"name": c.name, "predicted": c.goodput, "measured": measured["goodput_rate"],
                    "rates": measured["rates"]})
        print(f"  {c.name}: predicted {c.goodput:.2f} req/s, measured {measured['goodput_rate']:.2f}", flush=True)
    return out
