"""One request's generation state, shared by prefill (first token) and decode
(the rest). ``Sequence.resume`` rebuilds it on the decode side from what the
prefill side reported, so both ends detokenize and stop identically."""
from __future__ import annotations

from .detok import Detokenizer
from .errors import RequestError
from .sampling import SamplingParams, sample


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
        self.cache = None

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
        return cls(rid, ids, params, tokenizer, max_len)

    @classmethod
    def resume(cls, rid, prompt_len: int, first_token: int, emitted: int, params: SamplingParams, tokenizer, max_len: int):
        seq = cls(rid, [0] * prompt_len, params, tokenizer, max_len)
        seq.output_ids = [first_token]
        seq.detok = Detokenizer(tokenizer, params.stop, ids=[first_token], emitted=emitted)
        return seq

    @property
    def step_index(self) -> int:
        return len(self.output_ids)

    def accept(self, logits) -> str:
        """Sample the next token from ``logits``, returns the text delta to emit."""
        token = sample(logits, self.params, self.step_index)
        self.output_ids.append(token)
        if token == self.tokenizer.eos_token_id and not self.params.ignore_eos:
            self.finish_reason = "stop"
            self.detok.ids.append(token)
            return self.detok.flush()
        delta, stopped = self.detok.add(token)
        if stopped:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= self.max_len:
            self.finish_reason = "length"
            delta += self.detok.flush()
        return delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
