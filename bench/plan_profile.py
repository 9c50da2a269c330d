"""Measuring a profile (``profile.Profile``) on this machine: ``pdserve bench engine --profile``.

Prefill: one prompt of each length in ``prompts`` run to its first token (chunked as the engine chunks it), after
one untimed prompt of the same length. Decode: ``bench.engine.decode_rate`` at every batch size and context of
the grid that fits the pool."""
from __future__ import annotations

import sys
import time

from planner.profile import Profile


def prefill_ms(engine, tokens: int, rng) -> float:
    from .engine import _seqs, _sync, _vocab

    best = None
    for _ in range(2):  # the first run compiles and grows the allocator
        prompt = [rng.randrange(3, _vocab(engine)) for _ in range(tokens)]
        seq = _seqs(engine, [prompt], [1])[0]
        _sync(engine.device)
        start = time.perf_counter()
        engine.add(seq)
        while not seq.output_ids:
            engine.step()
        _sync(engine.device)
        best = (time.perf_counter() - start) * 1e3
        while engine.has_work:
            engine.step()
        engine.free(seq)
    return best


def measure(engine, batches: list[int], prompts: list[int], contexts: list[int], steps: int, rng) -> Profile:
    from .engine import decode_rate

    capacity = engine.num_blocks * engine.block_size
    prompts = [n for n in prompts if n < engine.max_len - 1] or [engine.max_len // 4, engine.max_len // 2]
    prefill = []
    for n in prompts:
        prefill.append({"tokens": n, "ms": prefill_ms(engine, n, rng)})
        print(f"profile prefill {n:>6} tokens: {prefill[-1]['ms']:.2f} ms", file=sys.stderr, flush=True)
    decode = []
    for context in [c for c in contexts if c + steps + 16 < engine.max_len]:
        for b in batches:
            if b * (context + steps + 16) > capacity:
                continue
            d = decode_rate(engine, b, context, steps, rng)
            rows = d["tokens"] / steps  # sequences a step advanced: less than the batch if some were preempted
            decode.append({"batch": b, "context": context, "step_ms": d["step_ms"], "rows": round(rows, 2)})
            print(f"profile decode batch {b:>3} x {context:>6}: {d['step_ms']:.2f} ms/step"
                  + (f" (only {rows:.1f} rows a step)" if rows < 0.99 * b else ""), file=sys.stderr, flush=True)
    tp = engine.group.size if hasattr(engine, "group") else 1
    return Profile(model=engine.name, device=str(engine.device), tp=tp, prefill=prefill, decode=decode,
                   kv_bytes_per_token=int(engine.kv_bytes_per_token) * tp, kv_capacity_tokens=capacity,
                   max_batched_tokens=engine.scheduler.max_batched_tokens)
