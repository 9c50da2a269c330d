"""``--roles auto --roles-profile PATH``: the split the planner's model serves best for the recent traffic.

Every ``DECIDE_S`` the router hands the planner's simulation (``planner.simulate``, in a process of its own: it is
CPU work the router's loop must not wait on) the traffic of the last 20 s (``router.traffic``): the arrival rate
and, of the requests that ended, their prompt (uncached) and output tokens, at least ``MIN_ENDED`` of them. For every
split of the mixed workers (``k`` of them prefill, the rest decode, beside the workers started with a role) it
simulates ``HORIZON_S`` of Poisson arrivals at that rate with those lengths on the profile (``pdserve bench engine
--profile``) and scores the share of requests within the TTFT and TPOT SLOs (``--slo-ttft-ms``, ``--slo-tpot-ms``).
The best split is the goal unless the current one scores within ``MARGIN`` of it; a goal counts once ``AGREE``
decisions in a row name it (hysteresis: one burst moves nothing). ``router.role_control`` then moves one worker a
cooldown toward it. Without enough ended requests there is no goal, and the pressure rules decide."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from control.lifetime import die_with_parent
from planner.profile import Profile
from planner.search import SLO, Candidate, Horizon, attainment, workload_requests
from planner.simulate import simulate

log = logging.getLogger(__name__)
DECIDE_S = 5.0  # with the 20 s window of router.traffic (bench.lab.roles_window)
HORIZON_S = 30.0
MAX_REQUESTS = 900
MIN_ENDED = 20
MARGIN = 0.05
AGREE = 2
LINK_GB_S = 50.0  # the simulated KV link between workers (the planner's default; the router does not measure it)


def scores(profile: Profile, fixed: tuple[int, int], mixed: int, rate: float, lengths: list, slo: SLO,
           local_tokens: int | None = None, seed: int = 0) -> dict[int, float]:
    """``k`` (mixed workers prefilling) -> the share of simulated requests within the SLOs, for every split that
    leaves each side a worker (``fixed``: the workers started as prefill and as decode)."""
    out = {}
    for k in range(mixed + 1):
        prefill, decode = fixed[0] + k, fixed[1] + mixed - k
        if not prefill or not decode:
            continue
        split = Candidate(f"{prefill}P{decode}D", "split", prefill=prefill, decode=decode, slo_tpot_ms=slo.tpot_ms,
                          disagg="always" if local_tokens is None else "auto")
        requests = workload_requests(lengths, rate, seed, Horizon(HORIZON_S, MAX_REQUESTS))
        out[k] = attainment(simulate(split.layout({1: profile}, LINK_GB_S, local_tokens), requests), slo)
    return out


def goal(scored: dict[int, float], current: int) -> int:
    """The best split (the nearest to ``current`` of equals), or ``current`` where it scores within ``MARGIN``."""
    if not scored:
        return current
    best = max(scored, key=lambda k: (scored[k], -abs(k - current)))
    return best if scored[best] > scored.get(current, 0.0) + MARGIN else current


def _score(path: str, *args) -> dict[int, float]:  # in the planning process
    return scores(Profile.load(path), *args)


def _tie_to(router_pid: int) -> None:
    """The planning process ends with the router (a killed router left it waiting on its own end of the pool's pipe)."""
    die_with_parent()
    if os.getppid() != router_pid:  # the router died before the tie was made
        os._exit(0)


class RolePlan:
    def __init__(self, profile_path: str, traffic, slo_ttft_ms: float, slo_tpot_ms: float,
                 local_tokens: int | None = None, metrics=None):
        Profile.load(profile_path)  # a bad file fails the router's start, not a pass
        self.path, self.traffic, self.local_tokens, self.metrics = profile_path, traffic, local_tokens, metrics
        self.slo = SLO(slo_ttft_ms, slo_tpot_ms)
        self.pool: ProcessPoolExecutor | None = None
        self.next_at, self.last, self.agreed = 0.0, None, 0
        self.scored: dict[int, float] = {}

    async def decide(self, now: float, fixed: tuple[int, int], mixed: int, current: int) -> int | None:
        """The number of mixed workers that should prefill, once ``AGREE`` decisions agree on it; None before (or
        while the traffic is too thin to say)."""
        if now < self.next_at:
            return self.last if self.agreed >= AGREE else None
        self.next_at = now + DECIDE_S
        lengths = self.traffic.lengths()
        if len(lengths) < MIN_ENDED or mixed == 0:
            return self._no_goal()
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_tie_to,
                                            initargs=(os.getpid(),))
        rate = self.traffic.rate()
        args = (self.path, fixed, mixed, rate, lengths, self.slo, self.local_tokens)
        try:
            self.scored = await asyncio.get_running_loop().run_in_executor(self.pool, _score, *args)
        except Exception as e:  # noqa: BLE001 - the planning process died (or the simulation failed): a new one next
            log.warning("roles plan: no decision (%s: %s); the pressure rules decide until the next", type(e).__name__, e)
            self.close()
            self.pool = None
            return self._no_goal()
        target = goal(self.scored, current)
        self.agreed = self.agreed + 1 if target == self.last else 1
        self.last = target
        if self.metrics is not None:
            for k, share in self.scored.items():
                self.metrics.plan_within_slo.labels(str(k)).set(share)
            self.metrics.plan_goal.set(target if self.agreed >= AGREE else -1)
        log.info("roles plan: %.1f req/s, %d requests: %s; goal %d of %d mixed prefilling (%d agreeing)",
                 rate, len(lengths), {k: round(v, 3) for k, v in self.scored.items()}, target,
                 mixed, self.agreed)
        return target if self.agreed >= AGREE else None

    def _no_goal(self) -> None:
        self.last, self.agreed = None, 0
        if self.metrics is not None:
            self.metrics.plan_goal.set(-1)
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
