"""Whole decode steps for ``pdserve bench kernels``: an engine with dummy weights of the named shape, ``batch``
sequences of ``context`` tokens prefilled (or contexts spread evenly over a range, as serving's rows are), then
``Engine.step`` timed (host work, sampling and emission included) and the captured graph's replay alone (device
work only), with the replay's kernels summed (``bench.profile_engine.replay_kernels``: attention, projections,
gaps). The bytes a step must read: every weight once (the embedding but for its rows, unless tied to the head)
plus each sequence's K/V."""
from __future__ import annotations

import random
import time


def weight_bytes(model) -> int:
    embed = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p is not embed or model.spec.tie_word_embeddings)


def step_cases(text: str) -> list[tuple[int, list[int]]]:
    """``BxC`` (B rows of C tokens) or ``BxLO-HI`` (B rows spread evenly from LO to HI), comma-separated."""
    cases = []
    for case in filter(None, text.split(",")):
        batch, ctx = case.split("x")
        lo, _, hi = ctx.partition("-")
        lo, hi, b = int(lo), int(hi or lo), int(batch)
        if b < 1 or lo < 1 or hi < lo:
            raise ValueError(f"step case {case!r}: want BxC or BxLO-HI with 1 <= LO <= HI")
        cases.append((b, [lo + (hi - lo) * i // max(1, b - 1) for i in range(b)]))
    return cases


def _label(contexts: list[int]) -> str:
    return str(contexts[0]) if min(contexts) == max(contexts) else f"{min(contexts)}-{max(contexts)}"


def _split(kernels: dict, kv_bytes: int, lim: dict) -> str:
    """Where the replay went: attention's kernels (and the K/V rate they read at), the rest, the gaps."""
    att, gap = kernels["replay_attention_ms"], kernels["replay_gap_ms"]
    rate = f" = {kv_bytes / att / 1e6 / lim['copy_GBps']:.0%} of copy bw" if att else ""
    gaps = f"gaps {gap:.2f}" if gap >= 0 else f"kernels overlap {-gap:.2f} (PDL: each counts its wait, shares inflated)"
    return f"; attention {att:.2f} ms{rate}, other kernels {kernels['replay_kernel_ms'] - att:.2f}, {gaps}"


def _engine(args, cases):
    from engine import EngineConfig
    from engine.factory import make_engine

    longest = max(max(c) for _, c in cases) + args.step_count + 32
    widest = max(b for b, _ in cases)
    budget = sum(sum(c) + b * (args.step_count + 48) for b, c in cases)  # tokens, all cases at once, generous
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
    for batch, contexts in cases:
        seqs = decoding(engine, batch, contexts, args.step_count + 12, rng, settle=3)
        _sync(engine.device)
        start = time.perf_counter()
        for _ in range(args.step_count):
            engine.step()
        _sync(engine.device)
        step_ms = (time.perf_counter() - start) * 1e3 / args.step_count
        size = next((s for s in graphs.sizes if s >= batch), None) if graphs else None
        replay_ms, kernels = None, {}
        if size in (graphs.graphs if graphs else {}):
            from ..profile_engine import replay_kernels
            from .cases import timed

            replay_ms = timed(graphs.graphs[size].replay, engine.device, reps=10, graph=False)
            kernels = replay_kernels(graphs.graphs[size].replay, replay_ms)
        nbytes = weights + (sum(contexts) + batch * args.step_count) * kv
        bound_ms = nbytes / (lim["copy_GBps"] * 1e6)
        ctx = sum(contexts) // batch
        for name, ms in (("step", step_ms), ("graph replay", replay_ms)):
            if ms is not None:
                rows.append({"name": f"{name} b{batch} ctx{_label(contexts)}", "batch": batch, "context": ctx,
                             "contexts": [min(contexts), max(contexts)], "ms": ms, "bytes": nbytes,
                             "tok_per_s": batch / ms * 1e3, "over_bound": ms / bound_ms,
                             **(kernels if name == "graph replay" else {}),
                             "note": f"{batch / ms * 1e3:.0f} tok/s, {ms / bound_ms:.2f}x bytes/copy-bw"
                             + (_split(kernels, nbytes - weights, lim) if name == "graph replay" and kernels else "")})
        for s in seqs:
            engine.free(s)
        torch.cuda.empty_cache() if engine.device.type == "cuda" else None
    if hasattr(engine, "close"):
        engine.close()
    return rows
