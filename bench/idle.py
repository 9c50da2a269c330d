"""``pdserve bench idle``: how fast the prefill forward runs depending on what
its process did just before, in one process, conditions interleaved.

A colocated worker runs a prompt right after decoding the previous request; a
disaggregated prefill worker runs it after waiting while decode ran elsewhere.
The same forward pass, the same weights, the same thread count: this bench
times it after each of these, taking turns, so the difference between
``after decode`` and ``after sleep`` is the part of a TTFT gap that no
transport or protocol can remove.

    pdserve bench idle [--prompt-len 871] [--gap-ms 330] [--reps 25] [--threads 1]"""
from __future__ import annotations

import json
import os
import statistics
import time

from deploy.progress import bar
from .report import command_line

CONDITIONS = ("back to back", "after decode", "after spin", "after sleep")


def add_arguments(p):
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=871)
    p.add_argument("--gap-ms", type=float, default=330.0, help="length of the spin, the sleep and roughly of the decode")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--out", default="bench/out/idle")


def run(args) -> int:
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.sequence import Sequence

    engine = Engine(EngineConfig(model=args.model, device=args.device, threads=args.threads, max_num_seqs=4,
                                 max_batched_tokens=max(2048, args.prompt_len)))
    vocab = engine.model.spec.vocab_size
    ids = [3 + i % (vocab - 3) for i in range(args.prompt_len)]
    gap = args.gap_ms / 1e3

    def run_one(prompt, max_tokens, until=None):
        seq = Sequence.create("idle", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                              engine.tokenizer, engine.max_len)
        engine.add(seq)
        while not seq.finished and (until is None or time.perf_counter() < until):
            engine.step()
        engine.free(seq)

    def forward() -> float:
        start = time.perf_counter()
        run_one(ids, 1)
        return (time.perf_counter() - start) * 1e3

    def decode():
        end = time.perf_counter() + gap
        run_one(ids[:64], engine.max_len - 64, until=end)

    def spin():
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass

    before = {"back to back": lambda: None, "after decode": decode, "after spin": spin,
              "after sleep": lambda: time.sleep(gap)}
    for _ in range(3):
        forward()
    samples = {c: [] for c in CONDITIONS}
    progress = bar(args.reps, "reps")
    for _ in range(args.reps):
        for condition in CONDITIONS:
            before[condition]()
            samples[condition].append(forward())
        progress.update()
    progress.close()
    base = statistics.median(samples["after decode"])
    summary = {c: {"median_ms": statistics.median(x), "min_ms": min(x), "vs_after_decode": statistics.median(x) / base}
               for c, x in samples.items()}
    lines = ["| prefill forward | median ms | min ms | vs after decode |", "|---|---|---|---|"]
    lines += [f"| {c} | {s['median_ms']:.2f} | {s['min_ms']:.2f} | {s['vs_after_decode']:.3f}x |" for c, s in summary.items()]
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    command = command_line("idle")
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "prompt_len": args.prompt_len, "gap_ms": args.gap_ms, "summary": summary,
                   "samples": samples}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Prefill forward after different gaps ({args.model}, {args.prompt_len} tokens, "
                f"{args.gap_ms:.0f} ms gaps)\n\n`{command}`\n\n{text}\n")
    print(text)
    print(f"wrote {args.out}.json, {args.out}.md")
    return 0
