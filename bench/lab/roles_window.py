"""How soon ``--roles auto --roles-profile`` follows a shifting load, by its traffic window and decision cadence: the
shifting workload's arrivals (prompt-heavy and generation-heavy phases of 60 s) replayed through ``router.traffic``
on a simulated clock, each request ending its prompt's 0.3 s plus 8 ms a token after it arrived, and the role plan's
decisions (``router.role_plan.scores`` and ``goal``, two agreeing ones to move one worker) taken at the cadence given.
It prints, for each (window, cadence), when the split changed: the lag after each phase change.

    python -m bench.lab.roles_window --profile P.json [--rate 16] [--answers 1024,2048] [--windows 60:10,30:10,20:5]"""
from __future__ import annotations

import argparse
import random

from planner.profile import Profile
from planner.search import SLO
from router.role_plan import AGREE, MIN_ENDED, goal, scores
from router.traffic import Traffic

PHASE_S = 60.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def events(rate: float, answers: tuple[int, int], phases: int, seed: int) -> list[tuple[float, str, tuple]]:
    """Arrivals ("a") and ends ("e") of the shifting workload's requests, in time order."""
    rng, out = random.Random(seed), []
    for phase in range(phases):
        t = phase * PHASE_S
        while (t := t + rng.expovariate(rate)) < (phase + 1) * PHASE_S:
            if phase % 2 == 0:
                lengths = (rng.randint(3000, 6000), rng.randint(16, 64))
            else:
                lengths = (rng.randint(64, 256), rng.randint(*answers))
            out += [(t, "a", lengths), (t + 0.3 + lengths[1] * 0.008, "e", lengths)]
    return sorted(out)


def replay(profile: Profile, window_s: float, decide_s: float, rate: float, answers: tuple[int, int], slo: SLO,
           phases: int = 4, mixed: int = 4, seed: int = 0) -> list[tuple[float, int]]:
    """(when, mixed workers prefilling) at each change, from 2 (as ``--mixed 4`` settles)."""
    clock = Clock()
    traffic, todo = Traffic(window_s, clock), events(rate, answers, phases, seed)
    current, last, agreed, changes = mixed // 2, None, 0, [(0.0, mixed // 2)]
    for step in range(1, int(phases * PHASE_S / decide_s) + 1):
        now = step * decide_s
        while todo and todo[0][0] <= now:
            clock.now, kind, lengths = todo.pop(0)
            traffic.arrived() if kind == "a" else traffic.finished(*lengths)
        clock.now = now
        lengths = traffic.lengths()
        if len(lengths) < MIN_ENDED:
            continue
        target = goal(scores(profile, (0, 0), mixed, traffic.rate(), lengths, slo), current)
        agreed, last = (agreed + 1 if target == last else 1), target
        if agreed >= AGREE and target != current:
            current += 1 if target > current else -1
            changes.append((now, current))
    return changes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.roles_window")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--answers", default="1024,2048", help="the generation-heavy phase's answer lengths, LOW,HIGH")
    ap.add_argument("--windows", default="60:10,30:10,20:5", help="WINDOW_S:DECIDE_S pairs, comma-separated")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=15.0)
    args = ap.parse_args(argv)
    profile, slo = Profile.load(args.profile), SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    low, high = (int(x) for x in args.answers.split(","))
    print(f"phases of {PHASE_S:g} s: prompt-heavy from 0, 120; generation-heavy ({low}-{high} out) from 60, 180")
    for pair in args.windows.split(","):
        window, decide = (float(x) for x in pair.split(":"))
        changes = replay(profile, window, decide, args.rate, (low, high), slo)
        print(f"window {window:g} s, a decision every {decide:g} s: " +
              ", ".join(f"{k} prefilling at {t:g} s" for t, k in changes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
