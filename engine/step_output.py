"""What one engine step returns (``StepOutput``: the tokens it emitted, in order, and what it scheduled or refused),
and the prompt logprobs a prompt chunk's scores add to its sequence. Below the engine, so that its drivers (a
pipeline's, MLX's) use them without importing it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence


@dataclass
class StepOutput:
    tokens: list = field(default_factory=list)  # Emitted, in order (a sequence can have two: ``engine.emitted``)
    refused: list = field(default_factory=list)
    scheduled: list = field(default_factory=list)
    batch_tokens: int = 0
    decode_rows: int = 0


def add_prompt_logprobs(seq: Sequence, scores: torch.Tensor, start: int, chunk: int) -> None:
    """Logprobs of prompt tokens ``start+1 .. start+chunk`` (within the prompt) from this chunk's scores."""
    plist = seq.prompt_logprob_list = seq.prompt_logprob_list or [None]
    k = seq.params.prompt_logprobs
    logp = torch.log_softmax(scores.float(), dim=-1)
    for j in range(chunk):
        pos = start + j + 1
        if pos >= len(seq.prompt_ids) or pos != len(plist):
            continue
        row = logp[j]
        top = []
        if k:
            values, ids = torch.topk(row, k)
            top = list(zip(ids.tolist(), values.tolist()))
        plist.append((float(row[seq.prompt_ids[pos]]), top))
