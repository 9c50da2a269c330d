"""Workload shapes for ``bench serve``: prompt/output lengths and arrival times."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor jugs "
         "and every morning the river carries light across stone bridges toward distant hills").split()


@dataclass
class Request:
    prompt: str
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
    out = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:chars]


def build(count: int, prompt_len: str, max_tokens: str, seed: int = 0, jsonl: str | None = None) -> list[Request]:
    rng = random.Random(seed)
    if jsonl:
        with open(jsonl) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            raise ValueError(f"{jsonl} has no requests")
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
