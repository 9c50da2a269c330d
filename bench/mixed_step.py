"""What a step that decodes and also takes a prompt chunk costs (``pdserve bench engine --mixed-chunks 64,256``).

``rows`` sequences decode; for each chunk size ``n`` a fresh prompt of ``n`` tokens (nothing of it cached) is added
``repeats`` times, and the engine steps until that prompt's first token (``max_tokens`` 1: it leaves at once).
With ``context`` (a multiple of the block size) each timed chunk comes after that many tokens of its prompt
already computed (a prompt of the context alone runs first, untimed, and its blocks stay in the prefix cache):
the shape of a long prompt's later chunks, whose attention reads every earlier chunk. Every
step is timed from a drained device to a drained device (``Engine.step`` then a synchronize), so a decode-only step
and a mixed one are timed alike and the step ahead (``engine.overlap``) hides nothing. Per size: the median
decode-only step between them (``decode_ms``), the median mixed step (``mixed_ms``), and, once the decode rows are
gone, the median step of the same chunk alone (``prompt_ms``: the chunk's own compute). Then the line
``mixed = fixed + per_token x n`` over every mixed step, fitted as ``engine.step_budget`` fits it: ``fixed - decode``
is what any mixed step pays beyond its decode rows, and ``mixed - decode - prompt`` per size what mixing costs
beyond running the two apart."""
from __future__ import annotations

import statistics
import time

from engine.step_budget import fit_line


def _timed_step(engine, sync) -> tuple[object, float]:
    sync(engine.device)
    start = time.perf_counter()
    out = engine.step()
    sync(engine.device)
    return out, (time.perf_counter() - start) * 1e3


def _one_prompt(engine, make_seq, n: int, rng, vocab: int, sync, context: int = 0) -> list[tuple[int, int, float]]:
    """Steps (decode rows, prompt tokens, ms) until a fresh ``n``-token prompt, after ``context`` cached tokens of
    its own, has its first token."""
    prefix = [rng.randrange(3, vocab) for _ in range(context)]
    if prefix:
        _one_prompt(engine, lambda _: make_seq(prefix), 0, rng, vocab, sync)  # computed once; its blocks cached
    seq = make_seq(prefix + [rng.randrange(3, vocab) for _ in range(n)])
    engine.add(seq)
    steps = []
    while not seq.output_ids:
        out, ms = _timed_step(engine, sync)
        steps.append((out.decode_rows, out.batch_tokens - out.decode_rows, ms))
    if not seq.finished:  # a finished one's blocks are back already
        engine.free(seq)
    return steps


def measure(engine, decoding_seqs: list, chunks: list[int], repeats: int, rng, vocab: int, make_seq, sync,
            context: int = 0) -> dict:
    """``decoding_seqs``: the ``rows`` sequences already decoding (their second token out); freed here after the
    mixed steps, before the chunks run alone. ``make_seq(prompt)``: a greedy sequence of one output token."""
    rows = len(decoding_seqs)
    by_size = {n: {"decode": [], "mixed": [], "alone": []} for n in chunks}
    for n in chunks:
        for _ in range(repeats):
            for _ in range(2):
                out, ms = _timed_step(engine, sync)
                if out.decode_rows == rows and out.batch_tokens == rows:
                    by_size[n]["decode"].append(ms)
            for d, p, ms in _one_prompt(engine, make_seq, n, rng, vocab, sync, context):
                if d == rows and p == n:
                    by_size[n]["mixed"].append(ms)
    for s in decoding_seqs:
        if not s.finished:
            engine.free(s)
    while engine.has_work:
        engine.step()
    for n in chunks:
        for _ in range(repeats):
            for d, p, ms in _one_prompt(engine, make_seq, n, rng, vocab, sync, context):
                if d == 0 and p == n:
                    by_size[n]["alone"].append(ms)
    return summarize(rows, by_size, context)


def summarize(rows: int, by_size: dict, context: int = 0) -> dict:
    sizes, points = [], []
    for n, t in by_size.items():
        if not (t["decode"] and t["mixed"] and t["alone"]):
            raise RuntimeError(f"chunk {n}: no {'decode' if not t['decode'] else 'mixed' if not t['mixed'] else 'alone'}"
                               " step of that shape (is --max-batched-tokens at least rows + chunk?)")
        decode, mixed, alone = (statistics.median(t[k]) for k in ("decode", "mixed", "alone"))
        sizes.append({"chunk": n, "decode_ms": decode, "mixed_ms": mixed, "prompt_ms": alone,
                      "beyond_apart_ms": mixed - decode - alone, "steps": len(t["mixed"])})
        points += [(n, ms) for ms in t["mixed"]]
    fit = fit_line(points)
    decode_ms = statistics.median(s["decode_ms"] for s in sizes)
    return {"rows": rows, "context": context, "sizes": sizes, "decode_ms": decode_ms,
            "fixed_ms": fit[0] if fit else None, "ms_per_token": fit[1] if fit else None,
            "fixed_beyond_decode_ms": fit[0] - decode_ms if fit else None}


def table(result: dict) -> str:
    after = f", each chunk after {result['context']} tokens of its prompt" if result.get("context") else ""
    lines = [f"Mixed steps beside {result['rows']} decode rows{after} (each step timed from a drained device):", "",
             "| prompt chunk | decode step ms | mixed step ms | chunk alone ms | mixed - decode - alone ms |",
             "|---|---|---|---|---|"]
    for s in result["sizes"]:
        lines.append(f"| {s['chunk']} | {s['decode_ms']:.2f} | {s['mixed_ms']:.2f} | {s['prompt_ms']:.2f} | "
                     f"{s['beyond_apart_ms']:+.2f} |")
    if result["fixed_ms"] is not None:
        lines += ["", f"Fit over the mixed steps: {result['fixed_ms']:.2f} ms + {result['ms_per_token'] * 1e3:.2f} us "
                      f"a prompt token; fixed cost beyond a decode step: {result['fixed_beyond_decode_ms']:+.2f} ms."]
    return "\n".join(lines)
