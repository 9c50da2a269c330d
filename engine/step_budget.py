"""How many prompt tokens a step that also decodes may take.

A decode worker that prefills prompts itself (``--disagg auto`` local
prefill, colocated workers) mixes prompt chunks into the steps that decode
its running sequences; every token of those chunks lengthens the step, and
so the time between two tokens of every running sequence (TPOT). The
scheduler caps the prompt tokens of such steps at ``tokens()``; steps with
nothing to decode take the full ``max_batched_tokens``.

The cap is either fixed (``step_prefill_tokens``) or learned from the
steps themselves to keep them within ``slo_tpot_ms``: step time is modelled
as ``base + per_token x prompt tokens``, ``base`` the mean of recent steps
that only decoded and ``per_token`` that of recent mixed steps' extra time
per prompt token (exponential averages). The cap is then
``(slo - base) / per_token``, at least one block (prompts always advance).

``StepLog`` keeps what the recent steps took, for the worker's ``info``
and tests: decode rows, prompt tokens, milliseconds."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest step in the averages
FIRST_CAP = 256  # learned cap before any mixed step was measured


@dataclass
class StepRecord:
    decode_rows: int
    prompt_tokens: int
    ms: float


class StepLog:
    def __init__(self, keep: int = 256):
        self.steps: deque[StepRecord] = deque(maxlen=keep)
        self.most_prompt_tokens_while_decoding = 0
        self.mixed_steps = 0

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        if record.decode_rows and record.prompt_tokens:
            self.mixed_steps += 1
            self.most_prompt_tokens_while_decoding = max(self.most_prompt_tokens_while_decoding,
                                                         record.prompt_tokens)


class PrefillBudget:
    def __init__(self, ceiling: int, floor: int, fixed: int | None = None, slo_tpot_ms: float | None = None):
        if fixed is not None and fixed < 1:
            raise ValueError("step_prefill_tokens must be a positive integer")
        if slo_tpot_ms is not None and slo_tpot_ms <= 0:
            raise ValueError("slo_tpot_ms must be positive")
        self.ceiling, self.floor = ceiling, max(1, min(floor, ceiling))
        self.fixed, self.slo_ms = fixed, slo_tpot_ms
        self.base_ms: float | None = None
        self.per_token_ms: float | None = None

    @property
    def active(self) -> bool:
        return self.fixed is not None or self.slo_ms is not None

    def tokens(self) -> int | None:
        """The cap on prompt tokens of a step that decodes (None: no cap)."""
        if self.fixed is not None:
            return min(self.fixed, self.ceiling)
        if self.slo_ms is None:
            return None
        if self.base_ms is None or self.per_token_ms is None:
            return max(self.floor, min(FIRST_CAP, self.ceiling))
        room = (self.slo_ms - self.base_ms) / max(self.per_token_ms, 1e-6)
        return int(max(self.floor, min(self.ceiling, room)))

    def observe(self, record: StepRecord) -> None:
        if not record.decode_rows:
            return
        if not record.prompt_tokens:
            self.base_ms = _average(self.base_ms, record.ms)
        elif self.base_ms is not None:
            extra = max(0.0, record.ms - self.base_ms) / record.prompt_tokens
            self.per_token_ms = _average(self.per_token_ms, extra)

    def info(self) -> dict:
        return {"step_prefill_cap": self.tokens(), "slo_tpot_ms": self.slo_ms,
                "step_base_ms": round(self.base_ms, 3) if self.base_ms is not None else None,
                "step_ms_per_prompt_token": round(self.per_token_ms, 5) if self.per_token_ms is not None else None}


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
