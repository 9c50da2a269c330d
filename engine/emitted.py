"""One token as a step hands it out: what the workers send for it.

A step's output can hold two tokens of one sequence (the step in flight read
first, then this step's: ``engine.overlap``), so nothing a worker sends may be
read off the sequence afterwards: its count, its last token and its finish by
then describe the later token. ``Emitted.of`` takes each token's own facts at
the moment it is accepted: its id, its place among the outputs (0 is the first
token), the finish it caused, the detokenizer's position and its logprobs (a copy:
``Sequence.take_logprobs`` still has them)."""
from __future__ import annotations

from typing import NamedTuple

from .sequence import logprob_entry


class Emitted(NamedTuple):
    seq: object  # engine.sequence.Sequence
    text: str  # the text this token completes (may be empty: a stop string pending, a partial character)
    token: int
    index: int  # 0 for the first output token
    finish_reason: str | None  # set on the token that ended its sequence
    emitted: int  # the detokenizer's position after it (a resumed sequence starts from there)
    logprobs: list | None  # wire entries of this token (None when logprobs were not asked for)

    @classmethod
    def of(cls, seq, text: str) -> "Emitted":
        """The token just appended to or filled into ``seq`` (places held after it are still pending)."""
        index = seq.num_output - 1
        logprobs = None
        if seq.params.logprobs is not None:  # its entry is the last one its acceptance added
            logprobs = [logprob_entry(seq.tokenizer, *seq.pending_logprobs[-1])] if seq.pending_logprobs else []
        return cls(seq, text, seq.output_ids[index], index, seq.finish_reason, seq.detok.emitted, logprobs)

    @property
    def first(self) -> bool:
        return self.index == 0
