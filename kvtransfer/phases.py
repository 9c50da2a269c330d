"""Per-transfer phase timing, filled by every transport.

Phases are wall-clock milliseconds; a phase a transport does not have is 0.
``d2h`` device-to-host copy on the sender, ``serialize`` turning tensors into
wire bytes, ``wire`` first byte sent to last byte received, ``deserialize``
turning bytes back into tensors, ``convert`` changing the dtype where the
receiving engine's differs from the sender's (a heterogeneous pair), ``h2d``
host-to-device copy on the receiver.
``wire`` is what remains of the receiver's first-to-last-byte time once the
sender's own work in between (and time it waited for prefill to produce layers)
is taken out, so phases do not overlap and ``total`` is their sum. Benchmarks
check that sum against an independent wall clock.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

PHASES = ("d2h", "serialize", "wire", "deserialize", "convert", "h2d")


@dataclass
class PhaseTimes:
    d2h: float = 0.0
    serialize: float = 0.0
    wire: float = 0.0
    deserialize: float = 0.0
    convert: float = 0.0
    h2d: float = 0.0
    bytes: int = 0

    @contextmanager
    def measure(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + (time.perf_counter() - start) * 1e3)

    @property
    def total(self) -> float:
        return sum(getattr(self, p) for p in PHASES)

    def gbps(self) -> float:
        return self.bytes * 8 / (self.total * 1e6) if self.total > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    @classmethod
    def from_dict(cls, d: dict) -> "PhaseTimes":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


def merge_ranks(own: PhaseTimes, reports: list[dict]) -> dict:
    """One transfer's phases over the ranks of a tensor-parallel group that moved it side by side: each phase the
    slowest rank's, bytes summed, every rank's own under ``ranks`` (``own`` is rank 0's; ``reports`` the others'
    ``{rank, phases}``)."""
    ranks = [own.to_dict()] + [r["phases"] for r in sorted(reports, key=lambda r: r["rank"])]
    out = {name: max(r.get(name, 0.0) for r in ranks) for name in PHASES}
    out["bytes"] = sum(r.get("bytes", 0) for r in ranks)
    out["total"] = sum(out[name] for name in PHASES)
    out["ranks"] = ranks
    return out
