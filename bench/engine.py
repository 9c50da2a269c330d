"""``pdserve bench engine``: the engine alone, in one process, no serving.

* decode: for each batch size, that many sequences of ``--prompt-len`` tokens
  are prefilled, then ``--decode-steps`` batched steps are timed: output tok/s
  of the whole batch and per-step latency;
* offline: ``--requests`` sequences with random prompt and output lengths
  added at once and run to completion (continuous batching, chunked prefill):
  output and total tok/s;
* ``--mixed-chunks``: steps that decode ``--mixed-rows`` sequences and take a
  prompt chunk, against decode-only steps and the chunk alone, and the fixed
  cost a mixed step pays (``bench.mixed_step``); with ``--mixed-context`` each
  chunk comes after that many tokens of its prompt (a long prompt's later chunks);
* ``--hf``: Hugging Face eager on the same weights, the same batch sizes
  (a padded-free batch of equal prompts, DynamicCache): the reference line.

    pdserve bench engine [--model tiny-llama] [--batches 1,8,32,64] [--decode-steps 64] [--hf]"""
from __future__ import annotations

import json
import os
import platform
import random
import sys
import time

from .report import command_line


def add_arguments(p):
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "mlx"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", default="32:512", help="offline prompt lengths, uniform in MIN:MAX")
    p.add_argument("--output-len", default="16:256", help="offline output lengths, uniform in MIN:MAX")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--mixed-chunks", default="", help="also time steps that decode --mixed-rows sequences and take "
                   "a prompt chunk of each of these sizes, e.g. 64,128,256,512 (bench.mixed_step)")
    p.add_argument("--mixed-rows", type=int, default=32)
    p.add_argument("--mixed-context", type=int, default=0, help="each timed chunk after this many tokens of its "
                   "prompt (cached; a multiple of the block size): a long prompt's later chunks")
    p.add_argument("--mixed-repeats", type=int, default=5)
    p.add_argument("--hf", action="store_true", help="also time Hugging Face eager batched decode")
    p.add_argument("--decode-graphs", choices=["auto", "off", "cuda"], default="auto")
    p.add_argument("--compare-eager", action="store_true",
                   help="also time decode with the fixed-shape path off (same engine, same run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read each decode step's tokens before launching the next (default: one step ahead)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of a shape (--model llama-3-70b) made on the GPUs, no checkpoint")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-budget", default="0", help="KV pool per rank, e.g. 8G (default: the engine's)")
    p.add_argument("--hbm-tbps", type=float, default=None, help="nominal memory bandwidth per GPU for the limit "
                   "line (default: known GPUs: H200 4.8, H100 3.35)")
    p.add_argument("--profile", action="store_true", help="also measure a profile for `pdserve plan` (prefill "
                   "times by prompt length, decode step times by batch and context): OUT-profile.json")
    p.add_argument("--profile-prompts", default="128,512,2048,8192", help="--profile: prompt lengths")
    p.add_argument("--profile-contexts", default="512,2048,8192", help="--profile: decode contexts")
    p.add_argument("--out", default="bench/out/engine")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seqs(engine, prompts, max_tokens):
    from engine import SamplingParams
    from engine.sequence import Sequence

    return [Sequence.create(f"b{i}", p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), engine.tokenizer,
                            engine.max_len) for i, (p, m) in enumerate(zip(prompts, max_tokens))]


def _vocab(engine) -> int:
    spec = getattr(engine.model, "spec", None)
    return min(spec.vocab_size, engine.tokenizer.vocab_size) if spec else engine.tokenizer.vocab_size


def prefill_steps(engine, lens: list[int]) -> int:
    """At most how many steps the prompts of ``lens`` take to be prefilled, one chunk of the step budget a step,
    and one step more each: how many tokens a row admitted first may decode before the last row's first token."""
    budget = getattr(getattr(engine, "scheduler", None), "max_batched_tokens", None) or 2048
    return sum(-(-n // budget) for n in lens) + len(lens)


def decoding(engine, batch: int, prompt_len, max_tokens: int, rng, settle: int = 0, prepare=None) -> list:
    """``batch`` random prompts of ``prompt_len`` tokens (or a length per prompt), added and stepped until every
    one decodes (its second token out), then ``settle`` steps more; ``prepare(seq)`` runs on each before it is
    added. Each may make ``max_tokens`` tokens from then on: the rows that started decoding while the last prompts
    were still prefilled get those steps on top (``prefill_steps``), so none ends inside a window the caller times."""
    vocab = _vocab(engine)
    lens = [prompt_len] * batch if isinstance(prompt_len, int) else list(prompt_len)
    assert len(lens) == batch, (len(lens), batch)
    room = max_tokens + settle + prefill_steps(engine, lens)
    seqs = _seqs(engine, [[rng.randrange(3, vocab) for _ in range(n)] for n in lens], [room] * batch)
    for s in seqs:
        if prepare is not None:
            prepare(s)
        engine.add(s)
    while any(len(s.output_ids) < 2 for s in seqs):
        engine.step()
    for _ in range(settle):
        engine.step()
    return seqs


def decode_rate(engine, batch: int, prompt_len: int, steps: int, rng, warmup: int = 8, guide=None) -> dict:
    """Output tok/s of ``steps`` batched decode steps, timed after ``warmup`` untimed ones at the same size (every
    sequence under ``guide``, a structured-output grammar, when given)."""
    from engine import SamplingParams
    from engine.requests import guided

    def under_guide(s):
        s.params = SamplingParams(**{**s.params.to_dict(), "guide": guide})
        guided(engine, s)

    seqs = decoding(engine, batch, prompt_len, steps + 4, rng, warmup, under_guide if guide else None)
    context = sum(s.num_tokens for s in seqs) / batch + steps / 2  # the rows' mean context mid-window
    _sync(engine.device)
    replays = _replays(engine)
    start, rows = time.perf_counter(), []
    for _ in range(steps):
        rows.append(len(engine.step().tokens))
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    replay_ms = _replay_ms(engine, replays)
    for s in seqs:
        engine.free(s)
    if min(rows) != batch or max(rows) != batch:  # a row that ended, or never decoded, would not be this batch
        raise RuntimeError(f"the timed steps decoded {min(rows)}-{max(rows)} rows, not {batch}")
    made = sum(rows)
    return {"batch": batch, "rows_per_step": batch, "context": round(context), "tokens": made, "seconds": elapsed,
            "tok_per_s": made / elapsed, "step_ms": elapsed / steps * 1e3,
            **({"replay_ms": replay_ms} if replay_ms is not None else {})}


def _replays(engine) -> tuple[int, float]:
    """The engine's decode graph replays timed so far (``cuda_graphs.replay_timer``), every completed one read."""
    engine.step_log.read_replays(engine.runner.graphs)
    t = engine.step_log.totals
    return t["graph_replays"], t["graph_ms"]


def _replay_ms(engine, before: tuple[int, float]) -> float | None:
    """Device time of one replay since ``before``: beside ``step_ms``, what the step spends off the device."""
    count, ms = _replays(engine)
    return (ms - before[1]) / (count - before[0]) if count > before[0] else None


def offline(engine, requests: int, input_len, output_len, rng) -> dict:
    vocab = _vocab(engine)
    ins = [rng.randint(*input_len) for _ in range(requests)]
    outs = [min(rng.randint(*output_len), engine.max_len - i - 1) for i in ins]
    seqs = _seqs(engine, [[rng.randrange(3, vocab) for _ in range(n)] for n in ins], outs)
    _sync(engine.device)
    start, steps = time.perf_counter(), 0
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
        steps += 1
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(s.output_ids) for s in seqs)
    return {"requests": requests, "prompt_tokens": sum(ins), "output_tokens": generated, "seconds": elapsed,
            "steps": steps, "output_tok_per_s": generated / elapsed, "total_tok_per_s": (generated + sum(ins)) / elapsed,
            "preemptions": engine.scheduler.preemptions}


def hf_decode_rate(engine, batch: int, prompt_len: int, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from engine.tiny import TINY_NAME, build_tiny_model

    if engine.cfg.model == TINY_NAME:
        model = build_tiny_model().to(engine.device, engine.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(engine.cfg.model, dtype=engine.dtype).to(engine.device)
    model.eval()
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=engine.device)
    with torch.inference_mode():
        cache = DynamicCache()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        for _ in range(8):
            nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        _sync(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            nxt.tolist()
        _sync(engine.device)
    elapsed = time.perf_counter() - start
    del model, cache
    return {"batch": batch, "tokens": batch * steps, "seconds": elapsed, "tok_per_s": batch * steps / elapsed,
            "step_ms": elapsed / steps * 1e3}


def mixed_steps(engine, args, rng) -> dict:
    """``bench.mixed_step`` beside ``--mixed-rows`` decoding sequences of ``--prompt-len`` tokens."""
    from engine import SamplingParams
    from engine.sequence import Sequence

    from .mixed_step import measure

    chunks = [int(x) for x in args.mixed_chunks.split(",")]
    steps = (5 + 4 * bool(args.mixed_context)) * args.mixed_repeats * len(chunks) + 8  # (each context runs first)
    seqs = decoding(engine, args.mixed_rows, args.prompt_len, steps, rng)

    def one_token(prompt):
        return Sequence.create(f"m{rng.random()}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                               engine.tokenizer, engine.max_len)

    return measure(engine, seqs, chunks, args.mixed_repeats, rng, _vocab(engine), one_token, _sync, args.mixed_context)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run(args) -> int:
    import torch

    from engine import EngineConfig
    from engine.factory import make_engine

    rng = random.Random(args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    from deploy.units import byte_size

    engine = make_engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                                      max_num_seqs=max(args.max_num_seqs, max(batches)), engine=args.engine,
                                      max_batched_tokens=args.max_batched_tokens, decode_graphs=args.decode_graphs,
                                      tp=args.tp, load_format=args.load_format, max_model_len=args.max_model_len,
                                      kv_budget_bytes=byte_size(args.kv_budget), overlap=args.overlap))
    getattr(engine, "warm_up", lambda: None)()  # as a worker does before it serves
    graphs = getattr(getattr(engine, "runner", None), "graphs", None)
    decode = [decode_rate(engine, b, args.prompt_len, args.decode_steps, rng) for b in batches]
    limit = hbm_limit(engine, args)
    for d in decode:
        if limit:
            d["hbm_limit_tok_per_s"] = limit["tok_per_s"](d["batch"], d["context"])
            d["fraction_of_limit"] = d["tok_per_s"] / d["hbm_limit_tok_per_s"]
        replay = f", replay {d['replay_ms']:.2f} ms on the device" if "replay_ms" in d else ""
        print(f"decode batch {d['batch']:>3} ({d['rows_per_step']} rows every timed step, context {d['context']}): "
              f"{d['tok_per_s']:9.1f} tok/s ({d['step_ms']:.2f} ms/step{replay})"
              + (f", {d['fraction_of_limit']:.0%} of the HBM limit {d['hbm_limit_tok_per_s']:.0f}" if limit else ""),
              file=sys.stderr)
    eager = []
    if args.compare_eager and graphs is not None:
        engine.runner.graphs = None
        eager = [decode_rate(engine, b, args.prompt_len, args.decode_steps, rng) for b in batches]
        engine.runner.graphs = graphs
        for d in eager:
            print(f"decode batch {d['batch']:>3}, no graphs: {d['tok_per_s']:9.1f} tok/s", file=sys.stderr)
    hf = [hf_decode_rate(engine, b, args.prompt_len, args.decode_steps) for b in batches] if args.hf else []
    for d in hf:
        print(f"HF eager batch {d['batch']:>3}: {d['tok_per_s']:9.1f} tok/s", file=sys.stderr)
    off = offline(engine, args.requests, _range(args.input_len), _range(args.output_len), rng)
    print(f"offline {off['requests']} requests: {off['output_tok_per_s']:.1f} output tok/s, "
          f"{off['total_tok_per_s']:.1f} total tok/s", file=sys.stderr)
    mixed = mixed_steps(engine, args, rng) if args.mixed_chunks else None
    profile = None
    if args.profile:
        from .plan_profile import measure

        profile = measure(engine, batches, [int(x) for x in args.profile_prompts.split(",")],
                          [int(x) for x in args.profile_contexts.split(",")], max(8, args.decode_steps // 4), rng)
    command = command_line("engine")
    base = decode[0]["tok_per_s"]
    report = {"command": command, "model": engine.name, "engine": getattr(engine, "kind", "torch"),
              "device": str(engine.device), "dtype": str(engine.dtype),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None},
              "kv_blocks": engine.num_blocks, "block_size": engine.block_size, "decode": decode, "hf_eager": hf,
              "decode_graphs": None if graphs is None else {"sizes": graphs.sizes, "captured": bool(graphs.graphs),
                                                            "replays": graphs.replays},
              "decode_without_graphs": eager, "offline": off, "tp": engine.group.size if hasattr(engine, "group") else 1,
              "overlap": getattr(engine.cfg, "overlap", None), "steps_ahead": getattr(engine, "overlapped", None),
              "hbm": {k: v for k, v in limit.items() if k != "tok_per_s"} if limit else None,
              "profile": profile.to_dict() if profile else None, "mixed_steps": mixed}
    lines = [f"| batch | pdserve tok/s | ms/step | vs batch {decode[0]['batch']} |"
             + (" HBM limit tok/s | of limit |" if limit else "")
             + (" without graphs tok/s |" if eager else "") + (" HF eager tok/s | pdserve / HF |" if hf else ""),
             "|---|---|---|---|" + ("---|---|" if limit else "") + ("---|" if eager else "") + ("---|---|" if hf else "")]
    for i, d in enumerate(decode):
        row = f"| {d['batch']} | {d['tok_per_s']:.1f} | {d['step_ms']:.2f} | {d['tok_per_s'] / base:.1f}x |"
        if limit:
            row += f" {d['hbm_limit_tok_per_s']:.0f} | {d['fraction_of_limit']:.0%} |"
        if eager:
            row += f" {eager[i]['tok_per_s']:.1f} |"
        if hf:
            row += f" {hf[i]['tok_per_s']:.1f} | {d['tok_per_s'] / hf[i]['tok_per_s']:.2f}x |"
        lines.append(row)
    text = "\n".join(lines) + (f"\n\nOffline: {off['requests']} requests, prompts {args.input_len}, outputs "
                               f"{args.output_len}: {off['output_tok_per_s']:.1f} output tok/s, "
                               f"{off['total_tok_per_s']:.1f} total tok/s, {off['preemptions']} preemptions.\n")
    if mixed:
        from .mixed_step import table

        text += "\n" + table(mixed) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    if profile is not None:
        profile.notes["command"] = command
        profile.save(args.out + "-profile.json")
    with open(args.out + ".md", "w") as f:
        f.write(f"# Engine throughput ({engine.name}, {engine.device}, {engine.dtype})\n\n`{command}`\n\n{text}")
    print(text)
    if hasattr(engine, "close"):
        engine.close()
    return 0


NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35}


def hbm_limit(engine, args) -> dict | None:
    """The decode rate if every step only read this rank's weights (but the embedding) and its batch's KV once at the GPU's nominal
    bandwidth (ranks read in parallel): ``tok_per_s(batch, context)``; None off CUDA or for an unknown GPU."""
    import torch

    if engine.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(engine.device)
    tbps = args.hbm_tbps or next((v for k, v in NOMINAL_TBPS.items() if k in name), None)
    if not tbps:
        return None
    from engine.models.moe import SparseMoE

    embed = engine.model.model.embed_tokens.weight  # decode reads a row of it (unless it is the tied lm_head)
    experts = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
    expert_params = {id(p) for m in experts for p in (m.w_gate_up, m.w_down)}
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()
                  if (p is not embed or engine.model.spec.tie_word_embeddings) and id(p) not in expert_params)
    kv = engine.kv_bytes_per_token

    def expert_bytes(batch: int) -> float:
        """A step reads each expert its batch routed to: with ``E`` experts and ``k`` per token spread evenly
        (random weights route about so), ``E * (1 - (1 - k/E) ** batch)`` per layer."""
        total = 0.0
        for m in experts:
            e, k = m.m.num_experts, m.m.top_k
            per = (m.w_gate_up.numel() + m.w_down.numel()) * m.w_down.element_size() / e
            total += e * (1 - (1 - k / e) ** batch) * per
        return total

    def tok_per_s(batch: int, context: int) -> float:
        return batch / ((weights + expert_bytes(batch) + batch * context * kv) / (tbps * 1e12))
    return {"gpu": name, "nominal_tb_per_s": tbps, "weight_bytes_per_rank": weights, "kv_bytes_per_token_per_rank": kv,
            "tok_per_s": tok_per_s}
