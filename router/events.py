"""What ``Service.generate`` yields for a request: ``Delta`` (tokens for the client, the first carrying the prompt's
count and its cached tokens) and, last, ``Finished`` (the reason, the token counts, the ``pdserve`` timing block and
the prompt's tokens the worker that computed its KV took from its cache: ``router.timing.note_cached``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Delta:
    text: str
    ids: list
    logprobs: list | None = None
    prompt_text: str | None = None
    prompt_logprobs: list | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timing: dict = field(default_factory=dict)
    cached_tokens: int = 0
