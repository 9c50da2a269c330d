"""Production request traces, read into one form: ``TraceRequest`` rows.

Two formats (``../shared/traces/README.md`` holds the public files and their attribution):

- Mooncake (FAST'25) JSONL: ``{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]}``,
  one id per 512-token block of the prompt, the last one covering its last, partial block; equal ids are equal
  blocks (a reusable prefix).
- Azure LLM inference 2023 (Splitwise, ISCA'24) CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``, the timestamp a
  date and time; no block ids, so every request gets blocks of its own (nothing is shared).

A trace recorded at ``trace_block`` tokens a block (``TRACE_BLOCK`` for both public traces) can be replayed at a
smaller ``block_size`` (the tiny model's context is short): every length is scaled by ``block_size / trace_block``
(at least one token), each block keeping its id, so the prefix sharing survives and the scale is reported with the
figures. A trace written already scaled says so with its ``trace_block``."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime

TRACE_BLOCK = 512  # tokens a block in both public traces
AZURE_IDS = 1 << 40  # Azure requests' own block ids start here (never equal to a Mooncake id)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # since the window's first request
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # one id per block of the prompt (the last may be partial)


def kind_of(path: str) -> str | None:
    """``mooncake`` or ``azure``, from the file's first line; None for anything else."""
    with open(path) as f:
        first = f.readline().strip()
    if first.startswith("{") and "input_length" in first:
        return "mooncake"
    if first.replace(" ", "").lower().startswith("timestamp,contexttokens,generatedtokens"):
        return "azure"
    return None


def _mooncake(path: str):
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield row["timestamp"] / 1e3, int(row["input_length"]), int(row["output_length"]), row["hash_ids"]


def _azure(path: str):
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
            prompt = int(row["ContextTokens"])
            ids = [AZURE_IDS + i * 1024 + b for b in range(-(-prompt // TRACE_BLOCK))]  # as recorded: 512 a block
            yield stamp, prompt, int(row["GeneratedTokens"]), ids


def _scaled(tokens: int, block_size: int, trace_block: int) -> int:
    return max(1, -(-tokens * block_size // trace_block))


def read(path: str, block_size: int = TRACE_BLOCK, start: int = 0, count: int | None = None,
         duration: float | None = None, trace_block: int = TRACE_BLOCK) -> list[TraceRequest]:
    """Requests ``start`` on (``count`` of them, or those arriving within ``duration`` seconds of the first), their
    arrivals from the first one's, lengths scaled from ``trace_block`` to ``block_size`` tokens a block."""
    kind = kind_of(path)
    if kind is None:
        raise ValueError(f"{path}: neither a Mooncake JSONL trace nor an Azure CSV trace")
    rows = _mooncake(path) if kind == "mooncake" else _azure(path)
    out: list[TraceRequest] = []
    first = None
    for i, (stamp, prompt, output, ids) in enumerate(rows):
        if i < start:
            continue
        first = stamp if first is None else first
        if (count is not None and len(out) >= count) or (duration is not None and stamp - first > duration):
            break
        if not ids or prompt <= 0:
            continue
        full = len(ids) - 1  # whole blocks before the last
        last = min(trace_block, max(1, prompt - full * trace_block))
        if block_size == trace_block:
            out.append(TraceRequest(stamp - first, full * trace_block + last, output, tuple(ids)))
        else:
            out.append(TraceRequest(stamp - first, full * block_size + _scaled(last, block_size, trace_block),
                                    _scaled(output, block_size, trace_block), tuple(ids)))
    if not out:
        raise ValueError(f"{path}: no requests in the window asked for (start {start})")
    return out


@dataclass(frozen=True)
class TraceWindow:
    """A window of a trace as ``bench replay`` sends it: its requests at their own arrival times, compressed by a
    speed. At a request rate ``r`` the speed is ``r`` over the window's own rate (its requests over its span), the
    rate ``bench replay`` reports for a speed; its bursts and lulls scale with it (Poisson arrivals at the same mean
    rate smooth them away, and predicted a third of the TTFT and a tenth of the TPOT measured on the Azure code
    trace)."""
    requests: tuple[TraceRequest, ...]

    @property
    def rate(self) -> float:
        span = self.requests[-1].arrival_s if len(self.requests) > 1 else 0.0
        return len(self.requests) / span if span > 0 else 1.0

    def at(self, rate: float) -> list[tuple[float, int, int]]:
        """(arrival ms, prompt tokens, output tokens) of every request at ``rate`` requests a second."""
        speed = rate / self.rate
        return [(r.arrival_s * 1e3 / speed, r.prompt_tokens, r.output_tokens) for r in self.requests]


def lengths(path: str) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of every request of a trace, for ``pdserve plan``."""
    return [(r.prompt_tokens, r.output_tokens) for r in read(path)]
