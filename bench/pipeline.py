"""``pdserve bench pipeline``: one device against two pipeline stages (``--pp 2``) against two tensor-parallel ranks
(``--tp 2``), in one run, on the CPU (or GPUs: ``--device``), the processes talking over a link of a given rate.

``--link lo:RATE`` (root, iproute2) runs the whole benchmark inside a network namespace made for it whose loopback
is shaped with ``tc tbf`` to RATE (``10gbit``, ``1gbit``): every byte between the processes (a pipeline's hidden
states over ``--pp-transport``, tcp by default; the tensor-parallel ranks' gloo all-reduces; the small step plans)
crosses that link; ``--link none`` uses the plain loopback. For each layout: decode tok/s at batch 1 and
``--batch``, one prompt's prefill time, and for the pipeline each hop's phases per step (d2h, serialize, wire,
deserialize) and bytes; for TP the bytes its all-reduces move per step (two per layer of ``tokens x hidden``).
Each layout uses the same two cores: one thread per process with two processes, two threads alone.
Writes JSON and Markdown."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from .report import command_line

NS_ENV = "PDSERVE_BENCH_NETNS"


def add_arguments(p):
    p.add_argument("--model", default="stream-cpu", help="a shape (with dummy weights) or a checkpoint directory")
    p.add_argument("--link", default="none", help="lo:RATE (e.g. lo:1gbit: a namespace with its loopback shaped) "
                   "or none")
    p.add_argument("--pp-transport", default="tcp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--layouts", default="single,pp2,tp2")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="tokens a step takes at most: a prompt "
                   "longer goes in chunks (which a pipeline overlaps)")
    p.add_argument("--device", default="cpu", help="cpu, or GPUs for the stages (cuda:0,cuda:1; cuda:0,cuda:0 shares "
                   "one: a check of the CUDA path, not a speed-up); one device runs the first")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench/out/pipeline")


def layout_config(args, layout: str):
    from engine import EngineConfig

    dummy = "auto" if os.path.isdir(args.model) else "dummy"
    parallel = {"single": {}, "pp2": {"pp": 2, "pp_transport": args.pp_transport}, "tp2": {"tp": 2}}[layout]
    device = args.device if layout != "single" else args.device.split(",")[0]
    return EngineConfig(model=args.model, load_format=dummy, dtype=args.dtype, device=device, warmup=False,
                        threads=2 if layout == "single" else 1, max_num_seqs=max(args.batch, 8),
                        max_batched_tokens=args.max_batched_tokens, **parallel)


def decode_steps(engine, batch: int, prompt_len: int, steps: int, rng) -> tuple[dict, list]:
    """Output tok/s of ``steps`` decode steps of ``batch`` sequences (after their prompts and 4 untimed steps),
    and the pipeline's hop totals just before the timed steps (empty without a pipeline)."""
    from .engine import decoding

    seqs = decoding(engine, batch, prompt_len, steps + 16, rng, settle=4)
    stage = getattr(engine, "stage", None)
    before = [dict(h) for h in stage.hop_totals] if stage is not None else []
    start, made = time.perf_counter(), 0
    for _ in range(steps):
        made += len(engine.step().tokens)
    elapsed = time.perf_counter() - start
    for s in seqs:
        engine.free(s)
    while engine.has_work:
        engine.step()
    return {"tok_per_s": made / elapsed, "outputs": [list(s.output_ids) for s in seqs]}, before


def hop_rates(engine, before: list) -> list:
    """Per hop, the phases of one step (ms, mean) since ``before`` (a copy of ``hop_totals``)."""
    out = []
    for i, now in enumerate(engine.stage.hop_totals):
        was = before[i] if i < len(before) else {}
        steps = now["count"] - was.get("count", 0)
        if steps:
            out.append({"hop": f"{i}->{(i + 1) % len(engine.stage.hop_totals)}", "steps": steps,
                        **{k: (now.get(k, 0) - was.get(k, 0)) / steps for k in
                           ("d2h", "serialize", "wire", "deserialize", "convert", "h2d", "bytes")}})
            out[-1]["total"] = sum(out[-1][k] for k in ("d2h", "serialize", "wire", "deserialize", "convert", "h2d"))
    return out


def prefill_ms(engine, length: int, rng) -> float:
    from engine import SamplingParams
    from engine.sequence import Sequence

    seq = Sequence.create("bench-prefill", [rng.randrange(3, 250) for _ in range(length)],
                          SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), engine.tokenizer, engine.max_len)
    start = time.perf_counter()
    engine.add(seq)
    while not seq.output_ids:
        engine.step()
    took = (time.perf_counter() - start) * 1e3
    engine.free(seq)
    while engine.has_work:
        engine.step()
    return took


def prompt_logprobs(engine, length: int = 96) -> list:
    """The logprob of each token of a fixed prompt given the ones before (teacher-forced: no sampling in the way),
    to compare layouts within the dtype's noise."""
    from engine import SamplingParams
    from engine.sequence import Sequence

    rng = random.Random(1)
    seq = Sequence.create("bench-logprobs", [rng.randrange(3, 250) for _ in range(length)],
                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), engine.tokenizer,
                          engine.max_len)
    engine.add(seq)
    while not seq.output_ids:
        engine.step()
    engine.free(seq)
    while engine.has_work:
        engine.step()
    return [e[0] for e in seq.prompt_logprob_list if e]


def measure(args, layout: str) -> dict:
    from engine.engine import Engine

    engine = Engine(layout_config(args, layout))
    spec, rng = engine.model.spec, random.Random(0)
    try:
        prefill_ms(engine, 16, rng)  # first-use costs
        row = {"layout": layout, "prefill_ms": prefill_ms(engine, args.prefill_len, rng), "decode": [],
               "prompt_logprobs": prompt_logprobs(engine)}
        for batch in (1, args.batch):
            d, before = decode_steps(engine, batch, args.prompt_len, args.decode_steps, rng)
            entry = {"batch": batch, "tok_per_s": d["tok_per_s"], "token_ms": 1e3 * batch / d["tok_per_s"],
                     "outputs": d["outputs"]}
            if layout == "pp2":
                entry["hops"] = hop_rates(engine, before)
            if layout == "tp2":
                entry["allreduce_bytes_per_step"] = 2 * spec.num_layers * batch * spec.hidden_size * 4
            row["decode"].append(entry)
        return row
    finally:
        engine.close()


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def in_namespace(args, argv: list[str]) -> int:
    """Run this benchmark again inside a fresh namespace whose loopback is shaped to the rate of ``--link``."""
    rate = args.link.split(":", 1)[1]
    ns = f"pdbench{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                        "burst", "1mbit", "latency", "100ms"], check=True)
        env = {**os.environ, NS_ENV: args.link}
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve", *argv], env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(args) -> int:
    if args.link != "none" and not os.environ.get(NS_ENV):
        if not args.link.startswith("lo:"):
            print(f"--link {args.link!r}: give lo:RATE (e.g. lo:1gbit) or none", file=sys.stderr)
            return 2
        return in_namespace(args, sys.argv[1:])
    rows = []
    for layout in args.layouts.split(","):
        rows.append(measure(args, layout))
        free_device_memory()  # the next layout's weights (a 70B shape fills the GPUs once)
        d = rows[-1]["decode"]
        print(f"{layout:6} prefill {args.prefill_len}: {rows[-1]['prefill_ms']:8.1f} ms; decode "
              + ", ".join(f"bs{e['batch']} {e['tok_per_s']:.1f} tok/s" for e in d), file=sys.stderr)
    where = "CPU, 2 cores in all" if args.device == "cpu" else args.device
    md = [f"Link: {args.link}; model {args.model} ({args.dtype}, {where}); hidden states over "
          f"{args.pp_transport}; prompts in chunks of {args.max_batched_tokens or 'the default'} tokens. Greedy tokens "
          f"equal to the first layout's: the share of the decode steps' tokens, at batch 1 and {args.batch} (random weights: "
          f"near-flat logits, so a tie broken by the dtype's noise sends a sequence elsewhere); the prompt's logprobs, "
          f"teacher-forced, against the first layout's: the largest difference.", "",
          f"| layout | prefill ms | decode bs1 tok/s | decode bs{args.batch} tok/s | same tokens | "
          "prompt logprobs off: most / mean |", "|---|---|---|---|---|---|"]
    md += [f"| {r['layout']} | {r['prefill_ms']:.1f} | {r['decode'][0]['tok_per_s']:.1f} | "
           f"{r['decode'][1]['tok_per_s']:.1f} | {agreement(rows[0], r):.3f} | "
           f"{off(rows[0], r, max):.2e} / {off(rows[0], r, mean):.2e} |" for r in rows]
    hops = [(r["layout"], e) for r in rows for e in r["decode"] if e.get("hops")]
    if hops:
        md += ["", "| pipeline hop | batch | d2h ms | serialize ms | wire ms | deserialize ms | total ms | bytes |",
               "|---|---|---|---|---|---|---|---|"]
        md += [f"| {h['hop']} | {e['batch']} | {h['d2h']:.3f} | {h['serialize']:.3f} | {h['wire']:.3f} | "
               f"{h['deserialize']:.3f} | {h['total']:.3f} | {h['bytes']:.0f} |" for _, e in hops for h in e["hops"]]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command_line("pipeline"), "link": args.link, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"`{command_line('pipeline')}`\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def agreement(first: dict, row: dict) -> float:
    """The share of greedy tokens of ``row``'s decode runs equal to ``first``'s (same prompts: one seeded rng)."""
    same = total = 0
    for a, b in zip(first["decode"], row["decode"]):
        for x, y in zip(a["outputs"], b["outputs"]):
            same += sum(p == q for p, q in zip(x, y))  # (a pipeline lands fewer tokens in as many steps)
            total += min(len(x), len(y))
    return same / total if total else 1.0


def off(first: dict, row: dict, how) -> float:
    """``how`` (max, mean) of the differences between two layouts' teacher-forced prompt logprobs."""
    return how([abs(a - b) for a, b in zip(first["prompt_logprobs"], row["prompt_logprobs"])])


def mean(values: list) -> float:
    return sum(values) / len(values)
