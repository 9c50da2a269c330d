"""Every configuration of the GPUs given, and the goodput each is predicted to reach.

Candidates for ``gpus`` GPUs and the profiles given (one per TP degree):
``N colocated`` replicas of TP t (``N x t = gpus``), the same with the
prompt-token cap of steps that decode set from the TPOT SLO (``capped``),
and every ``xPyD`` split (prefill TP a, decode TP b, ``x a + y b = gpus``),
with every prompt prefilled remotely (``always``) and with ``--disagg auto``
(one candidate for each ``--disagg-prefill-wait-ms`` asked for: ``waits``).

Goodput: the highest Poisson request rate (for a trace: the rate of its
window replayed faster, its own arrival times kept) at which at least ``attainment``
of the requests (the first tenth, the warm-up, not counted, except in a trace's window; at least
``duration_s`` of arrivals, at most ``max_requests``, so that a rate is
sustained rather than a burst the queues absorb) meet the TTFT
and TPOT SLOs (and the longest-gap SLO when given): found by doubling, then
bisection, up to ``max_requests / duration_s`` (a goodput equal to it is a
lower bound). The workload and its arrivals are seeded, so the ranking is
deterministic: goodput, then fewer GPUs, then name."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .profile import Profile
from .simulate import Instance, Layout, SimRequest, simulate
from .traces import TraceWindow

BISECTIONS = 12
DEFAULT_WAIT_MS = 500.0  # the router's default ``--disagg-prefill-wait-ms``


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    stall_ms: float | None = None
    attainment: float = 0.9


@dataclass
class Candidate:
    name: str
    kind: str  # colocated | split
    replicas: int = 0
    prefill: int = 0
    decode: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    disagg: str = "always"
    slo_tpot_ms: float | None = None  # instances that prefill cap steps that decode to keep within it
    gpus: int = 0
    goodput: float = 0.0
    prefill_wait_ms: float = DEFAULT_WAIT_MS  # auto: the router's ``--disagg-prefill-wait-ms``

    def layout(self, profiles: dict[int, Profile], link_gb_s: float, local_tokens: int) -> Layout:
        if self.kind == "colocated":
            p = profiles[self.decode_tp]
            return Layout(colocated=[Instance(f"c{i}", "colocated", p, self.slo_tpot_ms) for i in range(self.replicas)])
        pre, dec = profiles[self.prefill_tp], profiles[self.decode_tp]
        return Layout(prefill=[Instance(f"p{i}", "prefill", pre) for i in range(self.prefill)],
                      decode=[Instance(f"d{i}", "decode", dec, self.slo_tpot_ms) for i in range(self.decode)],
                      local_tokens=local_tokens if self.disagg == "auto" else None, link_gb_s=link_gb_s,
                      prefill_wait_ms=self.prefill_wait_ms)

    def up_command(self, model: str, slo: SLO, gpu: bool = True) -> str:
        """The ``pdserve up`` of this configuration: over GPUs (``--gpus``, KV over nccl), or (a CPU profile)
        processes of this machine with the KV over tcp."""
        place = f" --gpus {self.gpus}" if gpu else ""
        if self.kind == "colocated":
            cmd = f"pdserve up --model {model} --colocated --decode {self.replicas}{place}"
            cmd += f" --tp {self.decode_tp}" if self.decode_tp > 1 else ""
            return cmd + (f" --slo-tpot-ms {slo.tpot_ms:g}" if self.slo_tpot_ms is not None else "")
        cmd = (f"pdserve up --model {model} --prefill {self.prefill} --decode {self.decode}{place} "
               f"--transport {'nccl' if gpu else 'tcp'}")
        if self.prefill_tp > 1 or self.decode_tp > 1:
            cmd += f" --prefill-tp {self.prefill_tp} --decode-tp {self.decode_tp}"
        if self.disagg != "auto":
            return cmd
        wait = f" --disagg-prefill-wait-ms {self.prefill_wait_ms:g}" if self.prefill_wait_ms != DEFAULT_WAIT_MS else ""
        return cmd + f" --disagg auto{wait} --slo-tpot-ms {slo.tpot_ms:g}"


def candidates(gpus: int, profiles: dict[int, Profile], slo: SLO,
               waits: tuple[float, ...] = (DEFAULT_WAIT_MS,)) -> list[Candidate]:
    """``waits``: the ``--disagg-prefill-wait-ms`` of the ``auto`` splits (each its own candidate)."""
    out = []
    for tp in sorted(profiles):
        if gpus % tp == 0:
            n = gpus // tp
            out.append(Candidate(f"{n}x colocated tp{tp}", "colocated", replicas=n, decode_tp=tp, gpus=gpus))
            out.append(Candidate(f"{n}x colocated tp{tp} capped", "colocated", replicas=n, decode_tp=tp, gpus=gpus,
                                 slo_tpot_ms=slo.tpot_ms))
    for a in sorted(profiles):
        for b in sorted(profiles):
            for x in range(1, gpus // a + 1):
                rest = gpus - x * a
                if rest <= 0 or rest % b:
                    continue
                y = rest // b
                base = f"{x}P{y}D" + (f" tp{a}/{b}" if a > 1 or b > 1 else "")
                out.append(Candidate(base, "split", prefill=x, decode=y, prefill_tp=a, decode_tp=b, gpus=gpus))
                for wait in waits:
                    name = base + " auto" + (f" wait{wait:g}" if wait != DEFAULT_WAIT_MS else "")
                    out.append(Candidate(name, "split", prefill=x, decode=y, prefill_tp=a, decode_tp=b, disagg="auto",
                                         gpus=gpus, slo_tpot_ms=slo.tpot_ms, prefill_wait_ms=wait))
    return out


@dataclass(frozen=True)
class Horizon:
    duration_s: float = 60.0
    max_requests: int = 2000


def workload_requests(lengths, rate: float, seed: int, horizon: Horizon = Horizon()) -> list[SimRequest]:
    """Poisson arrivals at ``rate`` of the lengths given (cycled): ``duration_s`` of them, at least all the lengths
    once, at most ``max_requests``. ``lengths`` may be a function of (count, rate) giving them: a workload whose
    phases are seconds of arrivals (``shifting``) has lengths that depend on the rate; or a trace's window
    (``TraceWindow``), whose requests keep their own arrival times, sped up to ``rate``."""
    if isinstance(lengths, TraceWindow):
        return [SimRequest(*row) for row in lengths.at(rate)]
    if callable(lengths):
        count = min(horizon.max_requests, max(1, int(rate * horizon.duration_s)))
        lengths = lengths(count, rate)
    count = min(horizon.max_requests, max(len(lengths), int(rate * horizon.duration_s)))
    rng, t, out = random.Random(seed + 1), 0.0, []
    for i in range(count):
        prompt, output = lengths[i % len(lengths)]
        out.append(SimRequest(t, prompt, output))
        t += rng.expovariate(rate) * 1e3
    return out


def warmed(requests: list[SimRequest], work) -> list[SimRequest]:
    """The requests counted: all of a trace's window (as ``bench replay`` counts them), else after the first tenth."""
    return requests if isinstance(work, TraceWindow) else requests[len(requests) // 10:]


def attainment(requests: list[SimRequest], slo: SLO, work=None) -> float:
    counted = warmed(requests, work)
    good = sum(1 for r in counted if r.ttft_ms <= slo.ttft_ms and r.tpot_ms <= slo.tpot_ms
               and (slo.stall_ms is None or r.longest_gap <= slo.stall_ms))
    return good / max(1, len(counted))


def goodput(candidate: Candidate, profiles: dict[int, Profile], lengths: list[tuple[int, int]], slo: SLO,
            link_gb_s: float, local_tokens: int, seed: int = 0, horizon: Horizon = Horizon()) -> float:
    def meets(rate: float) -> bool:
        reqs = simulate(candidate.layout(profiles, link_gb_s, local_tokens),
                        workload_requests(lengths, rate, seed, horizon))
        return attainment(reqs, slo, lengths) >= slo.attainment

    top = horizon.max_requests / horizon.duration_s  # above it a run is shorter than duration_s: a burst
    lo, hi = 0.0, min(0.25, top)
    while meets(hi):
        if hi >= top:
            return top  # a lower bound: more requests or a shorter duration would test higher rates
        lo, hi = hi, min(hi * 2, top)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def rank(cands: list[Candidate], profiles: dict[int, Profile], lengths, slo: SLO, link_gb_s: float,
         local_tokens: int, seed: int = 0, horizon: Horizon = Horizon()) -> list[Candidate]:
    for c in cands:
        c.goodput = goodput(c, profiles, lengths, slo, link_gb_s, local_tokens, seed, horizon)
    return sorted(cands, key=lambda c: (-round(c.goodput, 6), c.gpus, c.name))


def predict_at(candidate: Candidate, profiles: dict[int, Profile], lengths, slo: SLO, link_gb_s: float,
               local_tokens: int, rate: float, seed: int = 0, horizon: Horizon = Horizon()) -> dict:
    """What the simulation predicts at one rate: attainment and TTFT/TPOT/stall quantiles (warm-up left out)."""
    from .stats import summary

    reqs = simulate(candidate.layout(profiles, link_gb_s, local_tokens),
                    workload_requests(lengths, rate, seed, horizon))
    counted = warmed(reqs, lengths)
    return {"rate": rate, "attainment": attainment(reqs, slo, lengths), "requests": len(counted),
            "ttft_ms": summary(r.ttft_ms for r in counted), "tpot_ms": summary(r.tpot_ms for r in counted),
            "stall_ms": summary(r.longest_gap for r in counted)}
