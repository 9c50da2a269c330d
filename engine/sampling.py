"""Sampling parameters and the token choice. A sampled token at step ``i`` uses
a generator seeded from ``(seed, i)``, so a request gives the same tokens
whether prefill and decode run in one process or two."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .errors import RequestError

MAX_STOP = 16
MAX_STOP_LEN = 256


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens < 1):
            raise RequestError("max_tokens must be a positive integer", param="max_tokens")
        if not 0.0 <= float(self.temperature) <= 2.0:
            raise RequestError("temperature must be between 0 and 2", param="temperature")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise RequestError("top_p must be in (0, 1]", param="top_p")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN for s in self.stop):
            raise RequestError(f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LEN} chars", param="stop")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    gen = torch.Generator(device="cpu").manual_seed((params.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
