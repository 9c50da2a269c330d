"""One request's generation state, shared by prefill (first token) and decode
(the rest). ``Sequence.resume`` rebuilds it on the decode side from what the
prefill side reported (prompt ids, first token, resolved parameters), so both
ends penalize, detokenize and stop identically.

``append`` takes a ``TokenChoice`` from the sampler and returns the text to
emit; the logprobs of appended tokens wait in ``pending_logprobs`` until the
worker sends them with that text."""
from __future__ import annotations

from .detok import Detokenizer
from .errors import RequestError
from .sampler import TokenChoice
from .sampling import SamplingParams

PENDING = -1  # an output place whose token is still on the device (``engine.overlap``)


class Sequence:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer, max_len: int):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.output_ids: list[int] = []
        self.detok = Detokenizer(tokenizer, params.stop)
        self.finish_reason: str | None = None
        self.pending_logprobs: list = []
        self.prompt_logprob_list: list | None = None
        self.block_table: list[int] = []
        self.num_computed = 0
        self.preemptions = 0
        self.scheduled_at: float | None = None
        self.first_seen: float | None = None  # when this engine first saw it decoding (``step_budget.decoding_rows``)
        self.block_keys: list[int] = []
        self.registered = 0
        self.cached_tokens = 0
        self.cached_by_tier: dict[str, int] = {}  # of cached_tokens: the pool's ("gpu") and a tier's ("host")
        self.counted = False
        self.pending = 0  # places held in output_ids for tokens still being chosen on the device
        self.freed = False  # taken out of the engine (finished or aborted)
        self.guide = None  # guided.grammars.Guide: the grammar its tokens follow
        self.pp_hops: list | None = None  # a pipeline's hops: per hop, phases summed over this sequence's steps
        self.hold_after_first = False  # leaves the scheduler after its first token, blocks kept (its KV goes away)

    @classmethod
    def create(cls, rid, prompt: str | list[int], params: SamplingParams, tokenizer, max_len: int) -> "Sequence":
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        if isinstance(prompt, list) and any(type(i) is not int or not 0 <= i < tokenizer.vocab_size for i in ids):
            raise RequestError(f"prompt token ids must be ints in [0, {tokenizer.vocab_size})", param="prompt")
        if len(ids) >= max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens; the prompt has {len(ids)} tokens", param="prompt")
        if params.max_tokens is None:
            params.max_tokens = max_len - len(ids)
        elif len(ids) + params.max_tokens > max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens; you requested {len(ids) + params.max_tokens} "
                f"({len(ids)} in the prompt, {params.max_tokens} for the completion)", param="max_tokens")
        if params.min_tokens > params.max_tokens:
            raise RequestError("min_tokens must not exceed max_tokens", param="min_tokens")
        return cls(rid, ids, params, tokenizer, max_len)

    @classmethod
    def resume(cls, rid, prompt_ids: list[int], first_token: int, emitted: int, params: SamplingParams, tokenizer,
               max_len: int, earlier: list[int] = ()):
        """Goes on from ``first_token``, the last token chosen elsewhere (after the output tokens ``earlier``: a
        sequence moved from another worker); its KV holds every token before it."""
        for name, ids in (("prompt_ids", prompt_ids), ("earlier", earlier)):
            if not isinstance(ids, (list, tuple)) or any(type(i) is not int for i in ids):
                raise RequestError(f"{name} must be a list of token ids", param=name)
        if not prompt_ids:
            raise RequestError("prompt_ids must be a non-empty list of token ids", param="prompt_ids")
        seq = cls(rid, prompt_ids, params, tokenizer, max_len)
        seq.output_ids = [*earlier, first_token]
        seq.detok = Detokenizer(tokenizer, params.stop, ids=seq.output_ids, emitted=emitted)
        return seq

    @property
    def step_index(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        p = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if start < p else []) + self.output_ids[max(0, start - p):max(0, end - p)]

    def _stops_on(self, token: int, count: int) -> bool:
        if self.guide is not None and self.guide.done:  # the grammar is complete (its stop token taken)
            return True
        if count <= self.params.min_tokens:
            return False
        if token in self.params.stop_token_ids:
            return True
        return token == self.tokenizer.eos_token_id and not self.params.ignore_eos

    def append(self, choice: TokenChoice) -> str:
        self.output_ids.append(choice.token)
        return self._accept(choice, len(self.output_ids))

    def reserve(self) -> int:
        """Hold the place of a token being chosen on the device (``engine.overlap``); its index for ``fill``."""
        self.output_ids.append(PENDING)
        self.pending += 1
        return len(self.output_ids) - 1

    def fill(self, index: int, choice: TokenChoice) -> str:
        """The token chosen for place ``index``: as ``append``; a finish drops any places held after it."""
        self.output_ids[index] = choice.token
        self.pending -= 1
        delta = self._accept(choice, index + 1)
        if self.finished:
            self.pending -= len(self.output_ids) - index - 1
            del self.output_ids[index + 1:]
        return delta

    @property
    def last_token(self) -> int:
        """The last chosen token (places still held on the device come after it)."""
        return self.output_ids[-1 - self.pending]

    @property
    def num_output(self) -> int:
        return len(self.output_ids) - self.pending

    @property
    def capped(self) -> bool:
        """Its last token (chosen or held) is the last it may have: nothing to compute after it."""
        return len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= self.max_len

    def _accept(self, choice: TokenChoice, count: int) -> str:
        token = choice.token
        if choice.logprob is not None:
            self.pending_logprobs.append((token, choice.logprob, choice.top))
        if self.guide is not None:
            self.guide.accept(token)
        if self._stops_on(token, count):
            self.finish_reason = "stop"
            return self.detok.flush()
        delta, stopped = self.detok.add(token, check_stop=count > self.params.min_tokens)
        if stopped:
            self.finish_reason = "stop"
        elif count >= self.params.max_tokens or len(self.prompt_ids) + count >= self.max_len:
            self.finish_reason = "length"
            delta += self.detok.flush()
        return delta

    def take_logprobs(self) -> list | None:
        """Wire entries for the tokens appended since the last call (None when logprobs were not asked for)."""
        if self.params.logprobs is None:
            return None
        out = [logprob_entry(self.tokenizer, *entry) for entry in self.pending_logprobs]
        self.pending_logprobs = []
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def logprob_entry(tokenizer, token: int, logprob: float, top: list) -> dict:
    """``{"t": text, "b": bytes, "lp": logprob, "top": [[text, bytes, logprob], ...]}`` for the control plane."""
    def piece(t):
        raw = tokenizer.token_bytes(t)
        return raw.decode("utf-8", errors="replace"), raw

    text, raw = piece(token)
    return {"t": text, "b": raw, "lp": logprob, "top": [[*piece(t), lp] for t, lp in top]}
