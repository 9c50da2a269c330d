"""Workload shapes for ``bench serve``, ``bench goodput`` and ``pdserve plan``: prompt/output lengths and
arrival times. ``uniform``: lengths uniform in the ranges given; ``mixed``: 70% prompts of 128-1,024 tokens and
30% of 6,000-8,000, outputs 128-512; ``mid``: prompts 1,000-4,000, outputs 128-512; ``long``: prompts 6,000-8,000,
outputs 128-256; ``shifting``: prompt-heavy phases (prompts 3,000-6,000, outputs 16-64) and generation-heavy ones
(prompts 64-256, outputs 256-512) alternating every ``SHIFT_S`` seconds of arrivals at the rate given (every
``SHIFT_REQUESTS`` requests without one); the named ones ignore the ranges given; a JSONL trace: its rows, in order."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .traces import kind_of
from .traces import lengths as trace_lengths

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor jugs "
         "and every morning the river carries light across stone bridges toward distant hills").split()


@dataclass
class Request:
    prompt: str | list[int]  # text, or token ids
    max_tokens: int


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` or ``"64:256"`` (uniform, inclusive)."""
    lo, _, hi = str(text).partition(":")
    lo, hi = int(lo), int(hi or lo)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length range {text!r}")
    return lo, hi


def synthetic_prompt(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of text (one token each for the built-in byte tokenizer)."""
    out, size = [], 0
    while size < chars:
        out.append(rng.choice(WORDS))
        size += len(out[-1]) + 1
    return " ".join(out)[:chars]


WORKLOADS = ("uniform", "mixed", "mid", "long", "shifting")
PRESETS = {"mid": ("1000:4000", "128:512"), "long": ("6000:8000", "128:256")}  # uniform ranges by name
MIXED = ((0.7, (128, 1024)), (0.3, (6000, 8000)))
MIXED_OUTPUT = (128, 512)
SHIFT_S, SHIFT_REQUESTS = 60.0, 64
SHIFTING = (((3000, 6000), (16, 64)), ((64, 256), (256, 512)))  # (prompt, output) ranges: prompt-heavy, then generation


def lengths(count: int, prompt_len: str, max_tokens: str, seed: int = 0, workload: str = "uniform",
            jsonl: str | None = None, rate: float | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of ``count`` requests; a JSONL row gives ``prompt_tokens`` (or a ``prompt``,
    a token per character as for the byte tokenizer) and ``max_tokens`` (or ``output_tokens``); a production trace
    (Mooncake JSONL, Azure CSV: ``planner.traces``) gives its requests' lengths, in order."""
    if jsonl and kind_of(jsonl):
        rows = trace_lengths(jsonl)
        return [rows[i % len(rows)] for i in range(count)]
    if jsonl:
        rows = _rows(jsonl)
        return [(int(r.get("prompt_tokens") or len(r.get("prompt", ""))),
                 int(r.get("output_tokens") or r.get("max_tokens") or parse_range(max_tokens)[0]))
                for r in (rows[i % len(rows)] for i in range(count))]
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} not in {WORKLOADS}")
    if workload in PRESETS:
        (prompt_len, max_tokens), workload = PRESETS[workload], "uniform"
    rng = random.Random(seed)
    if workload == "shifting":
        per_phase = max(1, round(SHIFT_S * rate)) if rate else SHIFT_REQUESTS
        phases = [SHIFTING[(i // per_phase) % 2] for i in range(count)]
        return [(rng.randint(*p), rng.randint(*o)) for p, o in phases]
    if workload == "mixed":
        out = []
        for _ in range(count):
            share = MIXED[0][1] if rng.random() < MIXED[0][0] else MIXED[1][1]
            out.append((rng.randint(*share), rng.randint(*MIXED_OUTPUT)))
        return out
    (plo, phi), (olo, ohi) = parse_range(prompt_len), parse_range(max_tokens)
    return [(rng.randint(plo, phi), rng.randint(olo, ohi)) for _ in range(count)]


def _rows(jsonl: str) -> list[dict]:
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{jsonl} has no requests")
    return rows


def build(count: int, prompt_len: str, max_tokens: str, seed: int = 0, jsonl: str | None = None,
          workload: str = "uniform", rate: float | None = None) -> list[Request]:
    rng = random.Random(seed)
    if workload in PRESETS and not jsonl:
        (prompt_len, max_tokens), workload = PRESETS[workload], "uniform"
    if workload != "uniform" and not jsonl:
        text = random.Random(seed + 7)
        return [Request(synthetic_prompt(text, p), o) for p, o in lengths(count, prompt_len, max_tokens, seed,
                                                                            workload, rate=rate)]
    if jsonl:
        rows = _rows(jsonl)
        return [Request(r["prompt"], int(r.get("max_tokens", parse_range(max_tokens)[0]))) for r in
                (rows[i % len(rows)] for i in range(count))]
    plo, phi = parse_range(prompt_len)
    olo, ohi = parse_range(max_tokens)
    return [Request(synthetic_prompt(rng, rng.randint(plo, phi)), rng.randint(olo, ohi)) for _ in range(count)]


def arrivals(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """Start offsets in seconds: all at once (closed loop) or a Poisson process at ``rate`` req/s."""
    if not rate:
        return [0.0] * count
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def longest_output(workload: str, max_tokens: str) -> int:
    """The most output tokens a request of this workload asks for."""
    if workload == "mixed":
        return MIXED_OUTPUT[1]
    if workload == "shifting":
        return SHIFTING[1][1][1]
    return parse_range(PRESETS[workload][1] if workload in PRESETS else max_tokens)[1]
