"""A discrete-event simulation of a serving configuration, step by step, from
an engine profile (``profile.Profile``).

Each instance (a worker: one GPU, or ``tp`` of them) runs steps as the
engine does: every decoding sequence advances one token, and prompt tokens
are taken first come first served up to ``max_batched_tokens`` (while
something decodes and ``slo_tpot_ms`` is set, only as many as keep the
step within what the decoding rows' mean TPOT can spare, at least the SLO's
step, or as many as make the step's prompt compute at least its
fixed cost, at least ``CAP_FLOOR``; no cap where even one prompt token
would take the step past the SLO: as ``--slo-tpot-ms`` does). A step that
decodes and takes prompt tokens is one forward over both (a mixed-step graph,
``engine.cuda_graphs.mixed``), which reads the weights once: it lasts
``decode_ms(rows, mean context)`` plus the prompt tokens' prefill time less
what the two share, a read of the weights: the prefill curve at 0 tokens (its
slope from its first point back; measured on an H200: 32 decode rows of 5.6
ms with 64, 256, 512-token chunks of 5.8, 9.3, 16.1 ms alone took 6.8, 10.1,
16.4 ms, ``engine-mixed-step-mistral7b-h200-2026-11-28.md``, where the curve
at 0 is ~3.3 ms: the model errs 1-2 ms long). A sequence is admitted when
its prompt and output fit the KV pool.

Roles: ``colocated`` instances prefill and decode; ``prefill`` instances
only prefill, then the KV takes ``tokens x kv_bytes_per_token / link`` to
reach the decode instance the request was given on arrival (as the router
picks decode first), then waits the profile's ``handoff_steps`` decode steps (what
serving adds: admission, the step already in flight; calibrated from measured
second tokens); ``decode`` instances decode and, with ``local_tokens``
(``--disagg auto``), prefill short prompts themselves (unless the step
taking one beside their decoding rows would break the TPOT SLO), and others when
every prefill instance's backlog takes ``prefill_wait_ms`` or more and
longer than the prompt would cost the decode instance (its backlog, and
the prompt's compute once for each of its decoding rows), as the router
decides. Every choice is the
least outstanding instance, as the router's default policy.

Per request: TTFT (the first token leaves the instance that prefilled),
TPOT ((last - first) / (tokens - 1)) and the longest gap between tokens."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.step_budget import least_slack

from .profile import Profile

CAP_FLOOR = 16


@dataclass
class SimRequest:
    arrival: float  # ms
    prompt: int
    output: int
    left: int = 0  # prompt tokens not yet computed
    tokens: int = 0  # emitted
    first: float | None = None
    last: float = 0.0
    finish: float | None = None
    longest_gap: float = 0.0
    dest: "Instance | None" = None  # remote prefill: the decode instance its KV goes to
    local: bool = True

    def __post_init__(self):
        self.left = self.prompt

    @property
    def ttft_ms(self) -> float:
        return self.first - self.arrival

    @property
    def tpot_ms(self) -> float:
        return (self.finish - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0

    def emit(self, now: float) -> None:
        if self.tokens:
            self.longest_gap = max(self.longest_gap, now - self.last)
        else:
            self.first = now
        self.tokens += 1
        self.last = now
        if self.tokens >= self.output:
            self.finish = now


@dataclass
class Instance:
    name: str
    role: str  # colocated | prefill | decode
    profile: Profile
    slo_tpot_ms: float | None = None
    queue: deque = field(default_factory=deque)  # prompts to compute
    decoding: list = field(default_factory=list)
    arriving: deque = field(default_factory=deque)  # KV received, waiting for room
    used: int = 0  # KV tokens reserved
    outstanding: int = 0
    busy: bool = False
    step: tuple = ()  # (decoding rows, [(request, chunk)])

    def plan(self, now: float = 0.0) -> float | None:
        """The next step's duration (ms) from ``now``, or None when there is nothing to do."""
        while self.arriving and self._fits(self.arriving[0]):
            req = self.arriving.popleft()
            self.used += req.prompt + req.output
            self.decoding.append(req)
        rows = list(self.decoding)
        decode_ms = self.decode_ms()
        budget = self.cap(decode_ms, now)
        chunks = []
        for req in self.queue:
            if budget <= 0:
                break
            if req.left == req.prompt:  # not started: reserve its KV
                need = req.prompt + (req.output if self.role != "prefill" else 0)
                if self.used + need > self.profile.kv_capacity_tokens and (self.used or chunks or rows):
                    break
                self.used += need
            chunk = min(req.left, budget)
            chunks.append((req, chunk))
            budget -= chunk
        if not rows and not chunks:
            return None
        self.step = (rows, chunks)
        prompt_tokens = sum(c for _, c in chunks)
        return self._mixed_ms(decode_ms, prompt_tokens) if rows else self.profile.prefill_ms(prompt_tokens)

    def decode_ms(self) -> float:
        rows = self.decoding
        context = sum(r.prompt + r.tokens for r in rows) / len(rows) if rows else 0
        return self.profile.decode_ms(len(rows), context)

    def cap(self, decode_ms: float, now: float | None = None) -> int:
        """The prompt tokens of the next step, as ``engine.step_budget`` chooses them (the rows' slack at ``now``;
        None: the SLO's step)."""
        budget = self.profile.max_batched_tokens
        if self.decoding and self.slo_tpot_ms is not None:
            per_token = self.profile.prefill_ms_per_token()
            fixed = self._mixed_ms(decode_ms, 1)
            if fixed < self.slo_tpot_ms:
                step_ms = max(self.slo_tpot_ms, self._allowance(decode_ms, now) if now is not None else 0.0)
                room = max((step_ms - fixed) / per_token, (fixed - decode_ms) / per_token)
                budget = int(max(CAP_FLOOR, min(budget, room)))
        return budget

    def _allowance(self, decode_ms: float, now: float) -> float:
        """``PrefillBudget.allowance`` over the decoding rows (0: none can spare more than the SLO's step)."""
        rows = [(r.tokens - 1, now - r.first, r.output - r.tokens) for r in self.decoding if r.first is not None]
        return least_slack(rows, self.slo_tpot_ms, decode_ms) or 0.0

    def breaks_tpot(self, prompt: int) -> bool:
        """As ``router.disagg``: the step taking ``prompt`` (at most the cap) beside the decoding rows is longer than
        the TPOT SLO this instance serves."""
        if self.slo_tpot_ms is None or not self.decoding:
            return False
        decode_ms = self.decode_ms()
        return self._mixed_ms(decode_ms, min(prompt, self.cap(decode_ms))) > self.slo_tpot_ms

    def _mixed_ms(self, decode_ms: float, prompt_tokens: int) -> float:
        if prompt_tokens <= 0:
            return decode_ms
        first = self.profile.prefill[0]["tokens"]
        weights = self.profile.prefill_ms(first) - self.profile.prefill_ms_per_token() * first  # the curve at 0 tokens
        return decode_ms + self.profile.prefill_ms(prompt_tokens) - min(decode_ms, max(0.0, weights))

    def _fits(self, req: SimRequest) -> bool:
        return self.used + req.prompt + req.output <= self.profile.kv_capacity_tokens or not self.used

    def finish_step(self, now: float) -> tuple[list, list]:
        """Apply the planned step; returns (requests whose prompt ended here, requests that finished)."""
        rows, chunks = self.step
        done, prefilled = [], []
        for req in rows:
            req.emit(now)
            if req.finish is not None:
                done.append(req)
        for req, chunk in chunks:
            req.left -= chunk
            if req.left == 0:
                self.queue.remove(req)
                req.emit(now)
                prefilled.append(req)
                if self.role == "prefill":
                    self.used -= req.prompt
                elif req.finish is not None:
                    done.append(req)
                else:
                    self.decoding.append(req)
        for req in done:
            if req in self.decoding:
                self.decoding.remove(req)
            self.used -= req.prompt + req.output
            self.outstanding -= 1
        return prefilled, done


@dataclass
class Layout:
    """A configuration to simulate: instances by role, and how requests are sent between them."""
    colocated: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    decode: list = field(default_factory=list)
    local_tokens: int | None = None  # decode instances prefill prompts of at most this many tokens (auto)
    prefill_queue: int = 4
    prefill_wait_ms: float = 500.0  # as the router's ``--disagg-prefill-wait-ms``
    link_gb_s: float = 50.0


def simulate(layout: Layout, requests: list[SimRequest]) -> list[SimRequest]:
    """Runs every request to its end; returns them with their times."""
    order = itertools.count()
    events = [(r.arrival, next(order), "arrive", r) for r in requests]
    heapq.heapify(events)

    def kick(inst: Instance, now: float) -> None:
        if not inst.busy:
            ms = inst.plan(now)
            if ms is not None:
                inst.busy = True
                heapq.heappush(events, (now + ms, next(order), "step", inst))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == "arrive":
            kick(_route(layout, obj), now)
        elif kind == "kv":
            obj.dest.arriving.append(obj)
            kick(obj.dest, now)
        else:
            obj.busy = False
            prefilled, _ = obj.finish_step(now)
            for req in prefilled:
                if obj.role == "prefill":
                    obj.outstanding -= 1
                    if req.finish is None:
                        ms = obj.profile.kv_transfer_ms(req.prompt, layout.link_gb_s) + handoff_ms(req.dest, req)
                        heapq.heappush(events, (now + ms, next(order), "kv", req))
                    else:
                        req.dest.outstanding -= 1
            kick(obj, now)
    return requests


def handoff_ms(dest: Instance, req: SimRequest) -> float:
    """What serving adds between a KV's arrival and its first decode step (admission, the step in flight): the
    profile's ``handoff_steps`` of the decode instance's current step (0 unless calibrated)."""
    steps = dest.profile.handoff_steps
    if not steps:
        return 0.0
    rows = len(dest.decoding) + 1
    context = (sum(r.prompt + r.tokens for r in dest.decoding) + req.prompt) / rows
    return steps * dest.profile.decode_ms(rows, context)


def _least(instances: list) -> Instance:
    return min(instances, key=lambda i: i.outstanding)


def _prefill_here(layout: Layout, queue: int, req: SimRequest, dest: Instance) -> bool:
    """As ``router.disagg``: every prefill instance's backlog (prompt tokens not yet computed) takes at least
    ``prefill_wait_ms``, and that wait is longer than what prefilling on ``dest`` costs (its own backlog, and the
    prompt's compute once for each row decoding there); with ``prefill_wait_ms`` 0, ``prefill_queue`` prompts or
    more in flight on each and fewer of its own on ``dest``."""
    if not layout.prefill_wait_ms:
        return queue >= layout.prefill_queue and len(dest.queue) < queue
    wait = min(p.profile.prefill_ms(sum(r.left for r in p.queue)) for p in layout.prefill)
    if wait < layout.prefill_wait_ms:
        return False
    per_token = dest.profile.prefill_ms_per_token()
    local = sum(r.left for r in dest.queue) * per_token + len(dest.decoding) * req.prompt * per_token
    return wait > local


def _route(layout: Layout, req: SimRequest) -> Instance:
    if layout.colocated:
        inst = _least(layout.colocated)
        inst.outstanding += 1
        inst.queue.append(req)
        return inst
    dest = _least(layout.decode)
    dest.outstanding += 1
    local = not layout.prefill
    if layout.local_tokens is not None and not local:
        queue = min(p.outstanding for p in layout.prefill)
        short = req.prompt <= layout.local_tokens and not dest.breaks_tpot(req.prompt)
        local = short or _prefill_here(layout, queue, req, dest)
    if local:
        dest.queue.append(req)
        return dest
    req.local, req.dest = False, dest
    inst = _least(layout.prefill)
    inst.outstanding += 1
    inst.queue.append(req)
    return inst
