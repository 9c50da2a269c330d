"""Plain in-process generation: the reference disaggregated serving must match."""
from __future__ import annotations

from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence


def generate(runner: ModelRunner, prompt, params: SamplingParams) -> tuple[str, list[int], str]:
    seq = Sequence.create("local", prompt, params, runner.tokenizer, runner.max_len)
    logits, kv = runner.prefill(seq.prompt_ids)
    text = seq.accept(logits)
    if not seq.finished:
        seq.cache = runner.cache_from(kv)
    while not seq.finished:
        text += seq.accept(runner.step(seq.cache, seq.output_ids[-1]))
    return text, seq.output_ids, seq.finish_reason
