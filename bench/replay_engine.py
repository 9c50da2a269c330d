"""The engine alone on a replay's prompts: the rate serving is measured against (``bench replay --engine-alone``).

The same token ids ``bench replay`` sent (same blocks, same salt, same order), the same forced output lengths,
added to one in-process engine as fast as it takes them, at most ``concurrency`` in flight (a request admitted when
one ends, as the replay's client does), no HTTP, router or worker loop between. The engine is built from the
engine options of ``--up-args`` (``engine_config``), so it is the served engine less the serving. Its prompt tokens
per second over the whole run, beside the served run's, is the share of the engine's rate that serving keeps.

Where the engine's time goes: every step's prompt chunks (tokens, and the keys before them) and decode rows are
recorded as it is scheduled, its time as the wall time between step returns; ``by_kind`` sums them by what the
step held (decode rows only, one prompt chunk, two, three or more: the packed varlen path) as TFLOP/s of the
forward's work (2 x the parameters outside the embeddings per token, 4 x layers x heads x dim per query-key pair
of causal attention)."""
from __future__ import annotations

import argparse
import shlex
import time

from planner.traces import TraceRequest

ENGINE_OPTIONS = ("--model", "--dtype", "--load-format", "--max-model-len", "--kv-budget", "--max-num-seqs",
                  "--max-batched-tokens", "--block-size", "--kv-cache-dtype", "--quantization", "--device")


def engine_config(up_args: str):
    """The ``EngineConfig`` of the workers ``pdserve up UP_ARGS`` starts (its engine options; the rest ignored)."""
    from deploy.units import byte_size
    from engine import EngineConfig

    p = argparse.ArgumentParser(add_help=False)
    for option in ENGINE_OPTIONS:
        p.add_argument(option, default=None)
    known, _ = p.parse_known_args(shlex.split(up_args))
    fields = {"model": known.model or "tiny-llama", "dtype": known.dtype or "auto",
              "load_format": known.load_format or "auto", "device": known.device or "auto",
              "kv_budget_bytes": byte_size(known.kv_budget) if known.kv_budget else 0,
              "kv_cache_dtype": known.kv_cache_dtype or "auto", "quantization": known.quantization}
    for name in ("max_model_len", "max_num_seqs", "max_batched_tokens", "block_size"):
        value = getattr(known, name)
        if value is not None:
            fields[name] = int(value)
    return EngineConfig(**fields)


def run(up_args: str, requests: list[TraceRequest], ids, concurrency: int) -> dict:
    """Every request's prompt (``ids(req)``) and forced output through one engine, ``concurrency`` at most at once;
    prompt tokens per second over the whole run, and the engine's own prefix counters."""
    import torch

    from engine import SamplingParams
    from engine.factory import make_engine
    from engine.sequence import Sequence

    engine = make_engine(engine_config(up_args))
    getattr(engine, "warm_up", lambda: None)()  # as a worker does before it serves
    held, schedule = [], engine.scheduler.schedule

    def recorded():  # each batch as scheduled, and when: a step lasts until the next is scheduled
        batch = schedule()
        if batch.seqs:
            held.append((time.perf_counter(), batch.decode_rows, [
                (n, s.num_computed) for s, n in zip(batch.seqs, batch.chunks) if n > 1 or not s.num_output]))
        return batch
    engine.scheduler.schedule = recorded
    seqs = [Sequence.create(f"r{i}", ids(r), SamplingParams(max_tokens=r.output_tokens, min_tokens=r.output_tokens,
                                                             temperature=0, ignore_eos=True),
                            engine.tokenizer, engine.max_len) for i, r in enumerate(requests)]
    before = engine.prefix_info()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start, waiting, live, steps = time.perf_counter(), list(reversed(seqs)), [], 0
    while waiting or live:
        while waiting and len(live) < concurrency:
            live.append(waiting.pop())
            engine.add(live[-1])
        engine.step()
        steps += 1
        live = [s for s in live if not s.finished]
    while engine.has_work:  # (one step ahead: the last step's tokens)
        engine.step()
    sync()
    end = time.perf_counter()
    wall = end - start
    after = engine.prefix_info()
    prompt = sum(r.prompt_tokens for r in requests)
    out = {"requests": len(requests), "prompt_tokens": prompt, "seconds": wall, "steps": steps,
           "prompt_tok_per_s": prompt / wall, "output_tokens": sum(len(s.output_ids) for s in seqs),
           "reused_tokens": after["prefix_cached_tokens"] - before["prefix_cached_tokens"],
           "preemptions": engine.scheduler.preemptions,
           "by_kind": by_kind(engine, [h[1:] for h in held], [b[0] - a[0] for a, b in zip(held, held[1:] + [(end,)])]),
           "config": {k: v for k, v in vars(engine.cfg).items() if isinstance(v, (int, float, str, type(None)))}}
    getattr(engine, "close", lambda: None)()
    return out


def kind_of(step: list) -> str:
    rows, chunks = step
    if not chunks:
        return "decode rows only"
    fresh = "fresh" if all(before == 0 for _, before in chunks) else "after cached keys"
    count = f"{len(chunks)} prompt chunk" + ("s" if len(chunks) > 1 else "") if len(chunks) < 3 else "3+ prompt chunks"
    return f"{count}, {fresh}" + (", with decode rows" if rows else "")


def by_kind(engine, held: list, seconds: list[float]) -> list[dict]:
    """Steps summed by what they held: count, prompt tokens, seconds, TFLOP/s of their forwards' work."""
    spec = getattr(engine.model, "spec", None)
    if spec is None:
        return []
    matmul = sum(p.numel() for p in engine.model.parameters()) - 2 * spec.vocab_size * spec.hidden_size
    pair = 4 * spec.num_layers * spec.num_heads * spec.head_dim
    kinds: dict[str, dict] = {}
    for step, s in zip(held, seconds):
        rows, chunks = step
        k = kinds.setdefault(kind_of(step), {"steps": 0, "prompt_tokens": 0, "decode_rows": 0, "seconds": 0.0,
                                             "flops": 0.0})
        tokens = sum(n for n, _ in chunks)
        k["steps"] += 1
        k["prompt_tokens"] += tokens
        k["decode_rows"] += rows
        k["seconds"] += s
        k["flops"] += 2 * matmul * (tokens + rows) + pair * sum(n * before + n * n / 2 for n, before in chunks)
    return [{"kind": name, **v, "tflops": v["flops"] / max(v["seconds"], 1e-9) / 1e12}
            for name, v in sorted(kinds.items(), key=lambda kv: -kv[1]["seconds"])]
