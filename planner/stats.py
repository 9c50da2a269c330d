"""Summaries of repeated measurements."""
from __future__ import annotations

import statistics


def quantile(values, q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values) -> dict:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "p90": quantile(values, 0.9),
            "p99": quantile(values, 0.99), "max": max(values), "n": len(values)} if values else {}
