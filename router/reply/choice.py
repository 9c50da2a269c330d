"""One choice of a response as it builds up: its text, ids, logprobs, finish, token counts and timing
(``absorb`` records each event of its stream), and the usage of several."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..events import Finished


@dataclass
class Choice:
    index: int
    prompt_index: int = 0
    text: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    offset: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, taken from the KV cache of the worker that computed it
    timing: dict = field(default_factory=dict)
    tool_calls: list | None = None  # parsed from the text (router.tools.parse); the text left is ``content``
    content: str | None = None


def absorb(choice: Choice, ev) -> tuple[str, list]:
    """Record an event on its choice; returns the text and logprob entries it adds."""
    if isinstance(ev, Finished):
        choice.finish_reason, choice.timing = ev.finish_reason, ev.timing
        choice.prompt_tokens, choice.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        choice.cached_tokens = ev.cached_tokens
        return "", []
    if ev.prompt_tokens is not None:
        choice.prompt_tokens = ev.prompt_tokens
    if ev.cached_tokens is not None:
        choice.cached_tokens = ev.cached_tokens
    choice.completion_tokens += len(ev.ids)
    text, entries = ev.text, list(ev.logprobs or [])
    if ev.prompt_text is not None:
        text, entries = ev.prompt_text + text, list(ev.prompt_logprobs or []) + entries
    choice.text.append(text)
    choice.ids.extend(ev.ids)
    choice.logprobs.extend(entries)
    return text, entries


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(choices: list[Choice]) -> dict:
    """Prompt tokens counted once per prompt, its cached tokens too (its first choice's: each choice computed the
    prompt on its own), completion tokens for every choice."""
    prompts: dict[int, Choice] = {}
    for c in choices:
        prompts.setdefault(c.prompt_index, c)
    return usage(sum(c.prompt_tokens for c in prompts.values()), sum(c.completion_tokens for c in choices),
                 sum(c.cached_tokens for c in prompts.values()))
