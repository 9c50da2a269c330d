"""What the first requests would otherwise pay for, paid before a worker says it is ready.

A fresh engine has captured its decode graphs, but its first prompts still compile kernels for the prefill
path (Triton's kernels specialize on shapes; FlashAttention's varlen and SDPA paths load on first use), grow
the CUDA caching allocator to a full step's activations (each new size is a ``cudaMalloc``), and warm the
sampler's paths (seeded sampling, logprobs). ``warm_up`` compiles every variant of the decode-attention kernel a
mixed step may pick, then runs a small workload of random prompts through the
engine's own ``step``: a full token budget of fresh prompts at once (chunked, varlen), one long prompt alone
(SDPA, the largest activations), and decode steps across the captured batch sizes, with the prefix cache off
so nothing of it is kept, then frees every block and resets the counters. On the CPU it is kept tiny."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

from .sampling import SamplingParams
from .sequence import Sequence

log = logging.getLogger(__name__)


def plan(engine) -> list[tuple[int, int, SamplingParams]]:
    """``(count, prompt length, params)`` groups of the warm-up."""
    gpu = engine.device.type == "cuda"
    budget = engine.scheduler.max_batched_tokens
    room = engine.max_len - 8
    decode = 1 if engine.hold_after_first else (8 if gpu else 2)
    width = min(engine.scheduler.max_num_seqs, 64 if gpu else 2)
    short = max(1, min(room, 512 if gpu else 16))
    sampled = SamplingParams(max_tokens=decode, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True, logprobs=2)
    groups = [(width, min(short, max(1, 2 * budget // width)), SamplingParams(max_tokens=decode, temperature=0,
                                                                             ignore_eos=True)),
              (1, short, sampled)]
    if gpu:
        groups.append((1, max(1, min(room, budget)), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    return groups


def _precompile(engine) -> None:
    """Every decode-attention variant a mixed step may pick (their count of decode rows varies)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return
    import torch

    spec, heads = engine.model.spec, engine.heads
    q = torch.zeros(1, heads.heads, spec.head_dim, dtype=engine.dtype, device=engine.device)
    k_cache, v_cache = engine.pool.layers[0]
    with torch.inference_mode():
        graphs.ops.precompile(q, k_cache, v_cache, spec.head_dim ** -0.5, spec.sliding_window or 0,
                              engine.scheduler.max_num_seqs)


def warm_up(engine) -> float:
    """Run the warm-up through ``engine``; seconds it took."""
    start = time.perf_counter()
    rng = random.Random(0)
    vocab = min(engine.model.spec.vocab_size, engine.tokenizer.vocab_size)
    caching, engine.blocks.caching = engine.blocks.caching, False
    _precompile(engine)
    try:
        for count, length, params in plan(engine):
            seqs = [Sequence.create(f"warmup-{i}", [rng.randrange(3, vocab) for _ in range(length)],
                                    replace(params), engine.tokenizer, engine.max_len)
                    for i in range(count)]
            for seq in seqs:
                engine.add(seq)
            while engine.has_work:
                engine.step()
            for seq in seqs:
                engine.free(seq)
    finally:
        engine.blocks.caching = caching
    engine.prompt_tokens = engine.cached_tokens = engine.prefix_hits = 0
    engine.tiers.tokens = dict.fromkeys(engine.tiers.tokens, 0)
    engine.scheduler.preemptions = 0
    seconds = time.perf_counter() - start
    log.info("warmed up in %.1fs", seconds)
    return seconds
