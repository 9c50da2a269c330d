"""Whole decode steps for ``pdserve bench kernels``: an engine with dummy weights of the named shape, ``batch``
sequences of ``context`` tokens prefilled, then ``Engine.step`` timed (host work, sampling and emission
included) and the captured graph's replay alone (device work only). The bytes a step must read: every weight
once (the embedding but for its rows, unless tied to the head) plus each sequence's K/V."""
from __future__ import annotations

import random
import time


def weight_bytes(model) -> int:
    embed = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p is not embed or model.spec.tie_word_embeddings)


def _engine(args, cases):
    from engine import EngineConfig
    from engine.factory import make_engine

    longest = max(c for _, c in cases) + args.step_count + 32
    widest = max(b for b, _ in cases)
    budget = sum(b * (c + args.step_count + 48) for b, c in cases)  # tokens, all cases at once, generous
    cfg = EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                       max_model_len=longest, max_num_seqs=widest, max_batched_tokens=16384)
    import torch

    from engine.models.llama import ModelSpec
    from engine.models.presets import preset_config

    spec = ModelSpec.from_hf(preset_config(args.model))
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * getattr(torch, args.dtype).itemsize
    engine = make_engine(EngineConfig(**{**cfg.__dict__, "kv_budget_bytes": budget * per_token}))
    engine.warm_up()
    return engine


def decode_steps(args, cases, lim) -> list:
    import torch

    from ..engine import _sync, decoding

    engine = _engine(args, cases)
    rng = random.Random(0)
    weights, kv = weight_bytes(engine.model), engine.kv_bytes_per_token
    graphs = engine.runner.graphs
    rows = []
    for batch, ctx in cases:
        seqs = decoding(engine, batch, ctx, args.step_count + 12, rng, settle=3)
        _sync(engine.device)
        start = time.perf_counter()
        for _ in range(args.step_count):
            engine.step()
        _sync(engine.device)
        step_ms = (time.perf_counter() - start) * 1e3 / args.step_count
        size = next((s for s in graphs.sizes if s >= batch), None) if graphs else None
        replay_ms = None
        if size in (graphs.graphs if graphs else {}):
            from .cases import timed

            replay_ms = timed(graphs.graphs[size].replay, engine.device, reps=10, graph=False)
        nbytes = weights + batch * (ctx + args.step_count) * kv
        bound_ms = nbytes / (lim["copy_GBps"] * 1e6)
        for name, ms in (("step", step_ms), ("graph replay", replay_ms)):
            if ms is not None:
                rows.append({"name": f"{name} b{batch} ctx{ctx}", "batch": batch, "context": ctx, "ms": ms,
                             "bytes": nbytes, "tok_per_s": batch / ms * 1e3, "over_bound": ms / bound_ms,
                             "note": f"{batch / ms * 1e3:.0f} tok/s, {ms / bound_ms:.2f}x bytes/copy-bw"})
        for s in seqs:
            engine.free(s)
        torch.cuda.empty_cache() if engine.device.type == "cuda" else None
    if hasattr(engine, "close"):
        engine.close()
    return rows
