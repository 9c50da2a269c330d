"""How many prompt tokens a step that also decodes may take.

A decode worker that prefills prompts itself (``--disagg auto`` local
prefill, colocated workers) mixes prompt chunks into the steps that decode
its running sequences; every token of those chunks lengthens the step, and
so the time between two tokens of every running sequence (TPOT). The
scheduler caps the prompt tokens of such steps at ``tokens()``; steps with
nothing to decode take the full ``max_batched_tokens``.

The cap is either fixed (``step_prefill_tokens``) or learned from the
steps themselves to keep the decoding rows' TPOT within ``slo_tpot_ms`` (the first mixed step,
which runs cold, left out): ``FIRST_CAP`` tokens until a mixed step was
measured, then ``PROBE_CAP`` (within the mixed-step graphs) until one of a second
size was (a 7k-token prompt in 256-token chunks gave the second size only at
its 28th step: on 4x H100 the first rate of a long-prompt sweep ran ~30 mixed
steps of 35 ms per worker before the fit found that no cap serves best). A step that only
decodes takes ``base`` (the mean of recent ones); a step that also takes
``n`` prompt tokens takes ``fixed + per_token x n``, fitted by least squares
over the recent mixed steps (``fixed`` holds the decode rows and what any
step with a prompt chunk pays once: on a GPU with mixed-step graphs, steps of
up to 1,024 tokens, about the decode step itself: 32 rows + 64-512-token
chunks on an H200 fit 4.90 ms + 22.1 us a token against a 5.6 ms decode step,
``engine-mixed-step-mistral7b-h200-2026-11-28.md``; larger steps and engines
without the graphs run one eager forward, tens of ms). The cap is
the larger of ``(step - fixed) / per_token`` (the chunk that keeps the step
within ``step``, the allowance below) and ``(fixed - base) / per_token`` (the chunk whose compute
is at least the fixed cost it pays: smaller chunks would spend most of the
step on overhead and prompts would fall behind), within one block and
``max_batched_tokens``. TPOT is a mean over a sequence's tokens, so before
each step the engine asks how long the step may take (``allowance``): for every
decoding row, what keeps its mean within the SLO if its remaining tokens come
at ``base``; the least of the rows that can still meet it, and at least the
SLO (rows fresh from their first token have hundreds of ms to spare; a cap on
every step at the SLO, the rule before, split prompts into many small mixed
steps, each paying ``fixed``: on one H200 the worker lost to no cap at all,
``goodput-mixed-1xh200-2026-11-29-8f82926-line-cap.md``). Where the SLO cannot be met by any step with a prompt
chunk (``fixed >= slo``: an eager mixed step, tens of ms), there is no cap:
every mixed step breaks the step time anyway, and the decoding sequences'
TPOT (a mean over their tokens) loses ``fixed`` per mixed step on top of
the chunk's compute, so fewer, larger chunks cost them least and prompts
move at full speed. Measured on 4x H100 (Mistral-7B shape, mixed workload,
2026-11-26, aa8ec07): colocated replicas with the old half-speed cap reached 4.5
req/s within TTFT 2 s / TPOT 10 ms, the same replicas uncapped 10.

``StepLog`` keeps what the recent steps took, for the worker's ``info``
and tests: decode rows, prompt tokens, milliseconds; and running totals
that tell where a decode worker's time goes under load: decode-only and
mixed steps (count, milliseconds; of decode-only steps the rows and their
context, the tokens their attention reads), the gaps between one step's end and
the next one's start while there was work (host time outside steps: the
control plane, KV arriving, the GIL), and the device time of the decode graph
replays (``cuda_graphs.replay_timer``: a step's wall time well above its replay's is host
time the device waited for)."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest decode-only step in its average
FIRST_CAP = 256  # learned cap before mixed steps of two sizes were measured
PROBE_CAP = 768  # then this, for the second size the fit needs (a long prompt would give it only at its last chunk);
# with its decode rows such a step stays within the mixed-step graphs (1,024 tokens): a probe beyond them ran
# eagerly, and a line through both kinds of step put the fixed cost above a 10 ms SLO (2x H200, mixed workload,
# 2026-11-28: fixed 11.8 ms, so no cap, where graph-replayed chunks pay ~5 ms)
WINDOW = 64  # mixed steps the fit looks at
RECENT_PROMPT_STEPS = 16  # steps with prompt tokens in ``prompt_ms_per_token`` (after the first, which ran cold)


@dataclass
class StepRecord:
    decode_rows: int
    prompt_tokens: int
    ms: float
    context_tokens: int = 0  # the decode rows' tokens so far, summed (what their attention reads)


class StepLog:
    def __init__(self, keep: int = 256):
        self.steps: deque[StepRecord] = deque(maxlen=keep)
        self.most_prompt_tokens_while_decoding = 0
        self.mixed_steps = 0
        self.prompt_steps: deque[StepRecord] = deque(maxlen=RECENT_PROMPT_STEPS)
        self.totals = {"decode_steps": 0, "decode_ms": 0.0, "decode_rows": 0, "decode_context": 0, "prompt_steps": 0,
                       "prompt_ms": 0.0, "prompt_tokens": 0, "gaps": 0, "gap_ms": 0.0, "gaps_over_5ms": 0,
                       "graph_replays": 0, "graph_ms": 0.0}

    def add(self, record: StepRecord, gap_ms: float | None = None) -> None:
        """``gap_ms``: since the step before ended, when this one follows it with work waiting."""
        self.steps.append(record)
        t = self.totals
        if record.decode_rows and record.prompt_tokens:
            self.mixed_steps += 1
            self.most_prompt_tokens_while_decoding = max(self.most_prompt_tokens_while_decoding,
                                                         record.prompt_tokens)
        if record.prompt_tokens:
            if t["prompt_steps"]:  # the first ran cold (lazy set-up, the allocator growing): 12 ms a token on a CPU
                self.prompt_steps.append(record)
            t["prompt_steps"] += 1
            t["prompt_ms"] += record.ms
            t["prompt_tokens"] += record.prompt_tokens
        else:
            t["decode_steps"] += 1
            t["decode_ms"] += record.ms
            t["decode_rows"] += record.decode_rows
            t["decode_context"] += record.context_tokens
        if gap_ms is not None:
            t["gaps"] += 1
            t["gap_ms"] += gap_ms
            t["gaps_over_5ms"] += gap_ms > 5.0

    def read_replays(self, graphs) -> None:
        """The decode graph replays of ``graphs`` (``DecodeGraphs`` or None) timed since the last read."""
        timer = graphs.timer if graphs is not None else None
        if timer is not None:
            self.add_replays(timer.done())

    def add_replays(self, times_ms: list[float]) -> None:
        """Device time of decode graph replays (``cuda_graphs.replay_timer``), as their events complete."""
        self.totals["graph_replays"] += len(times_ms)
        self.totals["graph_ms"] += sum(times_ms)

    def prompt_ms_per_token(self) -> float | None:
        """Milliseconds a prompt token, the median over the recent steps with prompt tokens, the first one ever left
        out (None until a second): what a prompt waits a token queued ahead of it (the router's ``--disagg auto``)."""
        if not self.prompt_steps:
            return None
        return statistics.median(r.ms / r.prompt_tokens for r in self.prompt_steps)  # a slow step or two barely moves it

    def info(self) -> dict:
        """Totals and means (ms) since start: decode-only steps, steps with prompt tokens, gaps between steps; and
        the recent prompt time a token."""
        t = self.totals
        return {**t, "prompt_ms_per_token": self.prompt_ms_per_token(),
                "decode_step_ms_mean": t["decode_ms"] / max(1, t["decode_steps"]),
                "decode_rows_mean": t["decode_rows"] / max(1, t["decode_steps"]),
                "decode_context_mean": t["decode_context"] / max(1, t["decode_rows"]),
                "prompt_step_ms_mean": t["prompt_ms"] / max(1, t["prompt_steps"]),
                "step_gap_ms_mean": t["gap_ms"] / max(1, t["gaps"]),
                "graph_ms_mean": t["graph_ms"] / max(1, t["graph_replays"])}


class PrefillBudget:
    def __init__(self, ceiling: int, floor: int, fixed: int | None = None, slo_tpot_ms: float | None = None):
        if fixed is not None and fixed < 1:
            raise ValueError("step_prefill_tokens must be a positive integer")
        if slo_tpot_ms is not None and slo_tpot_ms <= 0:
            raise ValueError("slo_tpot_ms must be positive")
        self.ceiling, self.floor = ceiling, max(1, min(floor, ceiling))
        self.fixed, self.slo_ms = fixed, slo_tpot_ms
        self.base_ms: float | None = None
        self.mixed: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.fit: tuple[float, float] | None = None  # (fixed ms, ms per prompt token) of mixed steps
        self.warm = False  # a mixed step was seen (the first is not learned from)

    @property
    def active(self) -> bool:
        return self.fixed is not None or self.slo_ms is not None

    def tokens(self, allowance_ms: float | None = None) -> int | None:
        """The cap on prompt tokens of a step that decodes (None: no cap); ``allowance_ms`` (``allowance``): how
        long the step may take with every decoding row's TPOT still projected within the SLO (at least the SLO)."""
        if self.fixed is not None:
            return min(self.fixed, self.ceiling)
        if self.slo_ms is None:
            return None
        if self.fit is None or self.base_ms is None:  # learning: a second size as soon as one was measured
            first = max(self.floor, min(FIRST_CAP, self.ceiling))
            tried = {n for n, _ in self.mixed}
            return first if first not in tried else max(self.floor, min(PROBE_CAP, self.ceiling))
        fixed_ms, per_token = self.fit
        if fixed_ms >= self.slo_ms:  # no chunk keeps a mixed step within the SLO: the fewest mixed steps
            return self.ceiling
        step_ms = max(self.slo_ms, allowance_ms or 0.0)
        within = (step_ms - fixed_ms) / per_token
        amortized = (fixed_ms - self.base_ms) / per_token
        return int(max(self.floor, min(self.ceiling, max(within, amortized))))

    def allowance(self, rows) -> float | None:
        """How long the next step may take, from the decoding rows ``(tokens after the first, ms since the first,
        tokens still to come)``: a row's TPOT is a mean, so a step may take what keeps
        ``(elapsed + step + (to_come - 1) x base) / (after_first + to_come)`` within the SLO, the least of the rows
        that can still meet it (a row short of one SLO of slack is held to the SLO's step at best anyway). None
        (the SLO's step) where no row has more, or before a decode step was timed."""
        if self.slo_ms is None or self.base_ms is None:
            return None
        return least_slack(rows, self.slo_ms, self.base_ms)

    def observe(self, record: StepRecord) -> None:
        if not record.decode_rows:
            return
        if not record.prompt_tokens:
            self.base_ms = _average(self.base_ms, record.ms)
            return
        if not self.warm:  # the first ran cold (a graph's first replay, the allocator growing): not the cost
            self.warm = True
            return
        self.mixed.append((record.prompt_tokens, record.ms))
        self.fit = fit_line(self.mixed) or self.fit

    def info(self) -> dict:
        fixed_ms, per_token = self.fit or (None, None)
        return {"step_prefill_cap": self.tokens(), "slo_tpot_ms": self.slo_ms,
                "step_base_ms": _round(self.base_ms, 3), "mixed_step_fixed_ms": _round(fixed_ms, 3),
                "step_ms_per_prompt_token": _round(per_token, 5)}


def least_slack(rows, slo_ms: float, step_ms: float) -> float | None:
    """Of ``rows`` ``(tokens after the first, ms since the first, tokens still to come)``, the least time a step may
    take with the row's mean time per token still within ``slo_ms`` once its other tokens come at ``step_ms``,
    over the rows that can spare at least ``slo_ms`` (None: no such row)."""
    slack = [slo_ms * (after + to_come) - elapsed - (to_come - 1) * step_ms
             for after, elapsed, to_come in rows if to_come > 0]
    held = [s for s in slack if s >= slo_ms]
    return min(held) if held else None


def decoding_rows(running, now: float) -> list[tuple[int, float, int]]:
    """``(tokens after the first, ms since the first was seen here, tokens still to come)`` of each sequence of
    ``running`` that decodes (``PrefillBudget.allowance``); a sequence's first sighting is stamped on it."""
    rows = []
    for seq in running:
        if seq.num_output and seq.num_tokens - seq.num_computed == 1:
            seq.first_seen = seq.first_seen or now
            to_come = min((seq.params.max_tokens or seq.max_len) - seq.num_output, seq.max_len - seq.num_tokens)
            rows.append((seq.num_output - 1, (now - seq.first_seen) * 1e3, to_come))
    return rows


def fit_line(points) -> tuple[float, float] | None:
    """Least-squares ``ms = fixed + per_token x n`` (None until two sizes were seen); a slope of at least 1 ns a
    token, an intercept of at least 0."""
    n = len(points)
    if n < 2:
        return None
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx <= 0:
        return None
    slope = max(1e-6, sum((p[0] - mx) * (p[1] - my) for p in points) / sxx)
    return max(0.0, my - slope * mx), slope


def _round(x, digits):
    return round(x, digits) if x is not None else None


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
