"""Plain in-process generation through the engine: the reference that
disaggregated serving must match."""
from __future__ import annotations

from .engine import Engine
from .sampling import SamplingParams
from .sequence import Sequence


def generate_all(engine: Engine, prompts: list, params: list[SamplingParams]) -> list[tuple[str, Sequence, list]]:
    """Run several prompts batched together until all finish; ``(text, sequence, logprob entries)`` each (the
    entries are empty unless ``params.logprobs`` is set)."""
    seqs = [Sequence.create(f"local-{i}", p, sp, engine.tokenizer, engine.max_len) for i, (p, sp) in enumerate(zip(prompts, params))]
    texts, logprobs = {id(s): "" for s in seqs}, {id(s): [] for s in seqs}
    for seq in seqs:
        engine.add(seq)
    while not all(s.finished for s in seqs):
        out = engine.step()
        if out.refused:
            raise RuntimeError(f"{len(out.refused)} sequences do not fit in the KV pool")
        for tok in out.tokens:
            if id(tok.seq) in texts:
                texts[id(tok.seq)] += tok.text
                logprobs[id(tok.seq)] += tok.logprobs or []
    return [(texts[id(s)], s, logprobs[id(s)]) for s in seqs]


def generate_many(engine: Engine, prompts: list, params: list[SamplingParams]) -> list[tuple[str, Sequence]]:
    """Run several prompts batched together until all finish; ``(text, sequence)`` each."""
    return [(text, seq) for text, seq, _ in generate_all(engine, prompts, params)]


def generate_sequence(engine: Engine, prompt, params: SamplingParams) -> tuple[str, Sequence, list]:
    """``(text, sequence, logprob entries)``; the entries are empty unless ``params.logprobs`` is set."""
    return generate_all(engine, [prompt], [params])[0]


def generate(engine: Engine, prompt, params: SamplingParams) -> tuple[str, list[int], str]:
    text, seq, _ = generate_sequence(engine, prompt, params)
    return text, seq.output_ids, seq.finish_reason
