"""Plain in-process generation: the reference disaggregated serving must match."""
from __future__ import annotations

from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence


def generate_sequence(runner: ModelRunner, prompt, params: SamplingParams) -> tuple[str, Sequence, list]:
    """``(text, sequence, logprob entries)``; the entries are empty unless ``params.logprobs`` is set."""
    seq = Sequence.create("local", prompt, params, runner.tokenizer, runner.max_len)
    logits, kv = runner.prefill(seq.prompt_ids)
    text = seq.accept(logits)
    if not seq.finished:
        seq.cache = runner.cache_from(kv)
    while not seq.finished:
        text += seq.accept(runner.step(seq.cache, seq.output_ids[-1]))
    return text, seq, seq.take_logprobs() or []


def generate(runner: ModelRunner, prompt, params: SamplingParams) -> tuple[str, list[int], str]:
    text, seq, _ = generate_sequence(runner, prompt, params)
    return text, seq.output_ids, seq.finish_reason
