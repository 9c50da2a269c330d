"""An engine's measured speed on one kind of device, the planner's input.

A profile (JSON, ``PROFILE_VERSION``) holds what ``pdserve bench engine
--profile`` measured for one model at one tensor-parallel degree:

- ``prefill``: ``[{"tokens": n, "ms": t}]``, one prompt of ``n`` tokens
  prefilled alone (a step of ``n`` prompt tokens);
- ``decode``: ``[{"batch": b, "context": c, "step_ms": t}]``, a decode step
  of ``b`` sequences of ``c`` tokens each;
- ``kv_bytes_per_token`` (all ranks), ``kv_capacity_tokens`` (the pool),
  ``max_batched_tokens``, ``tp``, ``device``, ``model``;
- ``kv_read_gb_s`` (optional, per GPU): how fast serving's decode steps
  read K/V, fitted from measured steps (``calibrate``) or given;
- ``prefill_scale`` (default 1): how much longer serving's prompt steps
  take than the profile's of as many tokens, fitted from prefill workers'
  steps (``calibrate``; 1P1D at 32 streams on 2x H100: 30 us a token
  against the engine's 25).

Times between the points are interpolated linearly (prefill in the token
count; decode in the batch, then in the context) and extrapolated from the
last two points. With ``kv_read_gb_s`` a decode step takes at least the
profile's step at its shortest context plus the extra context's K/V bytes at
that rate: the engine benchmark's decode steps (every sequence of one length)
ran faster at long contexts than serving's (mixed lengths, 2026-11-26, 8a9f8a5: 9.3
ms at 24.6 rows of ~2,700 tokens against a profile's 6.0 ms at 32 x 2,048)."""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field

PROFILE_VERSION = 1


@dataclass
class Profile:
    model: str
    device: str
    tp: int
    prefill: list[dict]
    decode: list[dict]
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_batched_tokens: int = 8192
    version: int = PROFILE_VERSION
    notes: dict = field(default_factory=dict)
    kv_read_gb_s: float | None = None
    handoff_steps: float = 0.0  # decode steps a received KV waits before its first (``calibrate.handoff_steps``)
    prefill_scale: float = 1.0  # serving's prompt steps over the profile's (``calibrate.prefill_scale``)

    def __post_init__(self):
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version}, this pdserve reads {PROFILE_VERSION}")
        if self.tp < 1 or self.kv_capacity_tokens < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("a profile needs tp, kv_capacity_tokens and kv_bytes_per_token >= 1")
        if self.kv_read_gb_s is not None and self.kv_read_gb_s <= 0:
            raise ValueError("kv_read_gb_s must be positive")
        if self.prefill_scale <= 0:
            raise ValueError("prefill_scale must be positive")
        if len(self.prefill) < 2 or any(p["tokens"] <= 0 or p["ms"] <= 0 for p in self.prefill):
            raise ValueError("a profile needs at least two prefill points with positive tokens and ms")
        if not self.decode or any(p["batch"] < 1 or p["context"] < 1 or p["step_ms"] <= 0 for p in self.decode):
            raise ValueError("a profile needs decode points with batch, context >= 1 and positive step_ms")
        self.prefill = sorted(self.prefill, key=lambda p: p["tokens"])
        self._prefill = _Curve([(p["tokens"], p["ms"]) for p in self.prefill])
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for p in self.decode:
            by_batch.setdefault(int(p["batch"]), []).append((int(p["context"]), float(p["step_ms"])))
        self._batches = _Curve([(b, 0.0) for b in sorted(by_batch)])  # its xs: the batches profiled
        self._by_context = [_Curve(sorted(by_batch[b])) for b in self._batches.xs]  # each batch's steps by context
        self._shortest = min(int(p["context"]) for p in self.decode)

    def prefill_ms(self, tokens: int) -> float:
        """A step of ``tokens`` prompt tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_scale * max(0.0, self._prefill.at(tokens))

    def decode_ms(self, batch: int, context: float) -> float:
        """A step of ``batch`` sequences of ``context`` tokens on average (0 for none)."""
        if batch <= 0:
            return 0.0
        ms = self.measured_decode_ms(batch, context)
        if self.kv_read_gb_s is None:
            return ms
        shortest = self.shortest_context()
        extra = batch * max(0.0, context - shortest) * self.kv_bytes_per_token
        return max(ms, self.measured_decode_ms(batch, shortest) + extra / (self.kv_read_gb_s * self.tp * 1e6))

    def measured_decode_ms(self, batch: int, context: float) -> float:
        """The profile's decode points alone, interpolated: along the context within the two batches profiled
        nearest ``batch``, then between them (the simulator asks this of every step: no list is built)."""
        batches, curves = self._batches.xs, self._by_context
        if len(batches) == 1:
            return max(1e-3, curves[0].at(context))
        i = self._batches.segment(batch)
        return max(1e-3, _between(batches[i - 1], curves[i - 1].at(context), batches[i], curves[i].at(context), batch))

    def shortest_context(self) -> int:
        return self._shortest

    def prefill_ms_per_token(self) -> float:
        """The prefill curve's slope between its first and last points."""
        lo, hi = self.prefill[0], self.prefill[-1]
        return self.prefill_scale * max((hi["ms"] - lo["ms"]) / (hi["tokens"] - lo["tokens"]), 1e-9)

    def kv_transfer_ms(self, tokens: int, link_gb_s: float) -> float:
        return tokens * self.kv_bytes_per_token / (link_gb_s * 1e9) * 1e3

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            data = json.load(f)
        data = data.get("profile", data)  # a bench engine report holds it under "profile"
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        try:
            return cls(**known)
        except TypeError as e:
            raise ValueError(f"{path} is not a pdserve profile: {e}") from None


class _Curve:
    """Piecewise linear through points sorted by x, extended along the end segments."""
    __slots__ = ("xs", "ys")

    def __init__(self, points: list[tuple[float, float]]):
        self.xs, self.ys = [p[0] for p in points], [p[1] for p in points]

    def segment(self, x: float) -> int:
        """``i``: the segment from point ``i - 1`` to point ``i`` that holds ``x`` (or the end one toward it)."""
        return min(max(bisect.bisect_left(self.xs, x), 1), len(self.xs) - 1)

    def at(self, x: float) -> float:
        if len(self.xs) == 1:
            return self.ys[0]
        i = self.segment(x)
        return _between(self.xs[i - 1], self.ys[i - 1], self.xs[i], self.ys[i], x)


def _between(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
