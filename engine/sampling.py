"""Sampling parameters of one sequence.

The router resolves what it can (seed, the completions default of 16 tokens);
the first worker resolves the rest (``max_tokens`` left open means "up to the
context limit") and hands the resolved parameters on, so a decode worker only
ever sees complete ones (``from_dict(..., resolved=True)`` insists)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import RequestError
from .guided.grammars import check_guide

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKENS = 64


def _check(ok: bool, message: str, param: str):
    if not ok:
        raise RequestError(message, param=param)


def _is_int(v) -> bool:
    return type(v) is int


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    guide: dict | None = None  # structured output: a grammar the tokens follow (guided.grammars)

    def __post_init__(self):
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens must be a positive integer", "max_tokens")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be a non-negative integer", "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens",
               "min_tokens")
        _check(0.0 <= float(self.temperature) <= 2.0, "temperature must be between 0 and 2", "temperature")
        _check(0.0 < float(self.top_p) <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k must be -1, 0 (off) or a positive integer", "top_k")
        _check(0.0 <= float(self.min_p) <= 1.0, "min_p must be in [0, 1]", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2.0 <= float(getattr(self, name)) <= 2.0, f"{name} must be between -2 and 2", name)
        _check(0.0 < float(self.repetition_penalty) <= 10.0, "repetition_penalty must be in (0, 10]", "repetition_penalty")
        _check(_is_int(self.seed), "seed must be an integer", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, list) and len(self.stop) <= MAX_STOP
               and all(isinstance(s, str) and s and len(s) <= MAX_STOP_LEN for s in self.stop),
               f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LEN} chars", "stop")
        _check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKENS
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be at most {MAX_STOP_TOKENS} non-negative integers", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                   f"{name} must be an integer between 0 and {MAX_LOGPROBS}", name)
        check_guide(self.guide)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, resolved: bool = False) -> "SamplingParams":
        if not isinstance(d, dict):
            raise RequestError("params must be a map", param="params")
        known = cls.__dataclass_fields__
        try:
            params = cls(**{k: v for k, v in d.items() if k in known})
        except RequestError:
            raise
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling parameters: {e}", param="params") from None
        if resolved and params.max_tokens is None:
            raise RequestError("unresolved sampling parameters: max_tokens is missing", param="max_tokens")
        return params
