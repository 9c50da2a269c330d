"""Where a decode step's time goes, on a GPU machine: launch and sync costs of the device, then a torch profile
of a few batched decode steps (top operators by CPU and device time).

    python -m bench.profile_engine --model DIR [--batch 32] [--steps 8] [--graph-times 1,32] [--prefill 16:512]
                                   [--tp 2] [--no-overlap]

Under ``--tp`` the profile is rank 0's (the others follow its steps) and graph times give the whole step only."""
from __future__ import annotations

import argparse
import re
import time


def micro(device) -> dict:
    import torch

    x = torch.zeros(16, device=device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - t) / 2000 * 1e6
    t = time.perf_counter()
    for _ in range(200):
        x.sum().item()
    sync_us = (time.perf_counter() - t) / 200 * 1e6
    t = time.perf_counter()
    for _ in range(200):
        torch.tensor([1, 2, 3], device=device)
    h2d_us = (time.perf_counter() - t) / 200 * 1e6
    return {"launch_us": launch_us, "item_sync_us": sync_us, "small_h2d_us": h2d_us}


def graph_times(engine, rng, sizes, prompt_len: int = 512) -> list:
    """Per batch size: one decode step through the engine, the captured graph's replay alone, and the Triton
    decode kernel alone on one layer (device time, synchronized around repeats)."""
    import torch

    from bench.engine import decoding
    from engine.kernels import triton_attention as triton_ops

    graphs, out = engine.runner.graphs, []

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps * 1e3

    for n in sizes:
        seqs = decoding(engine, n, prompt_len, 64, rng)
        step_ms = timed(engine.step, 10)
        out.append({"batch": n, "step_ms": step_ms})
        if engine.group.size == 1:  # under TP a graph holds collectives: the other ranks replay only with a step
            size = next(x for x in graphs.sizes if x >= n)
            replay_ms = timed(graphs.graphs[size].replay, 20)
            k_cache, v_cache = engine.pool.layers[0]
            spec = engine.model.spec
            q = torch.randn(n, spec.num_heads, spec.head_dim, device=engine.device, dtype=engine.dtype)
            kernel_ms = timed(lambda: triton_ops.decode(q, k_cache, v_cache, graphs.tables[:n], graphs.lens[:n],
                                                        spec.head_dim ** -0.5), 50)
            out[-1].update(graph_replay_ms=replay_ms, decode_kernel_ms_one_layer=kernel_ms, host_ms=step_ms - replay_ms,
                           **replay_kernels(graphs.graphs[size].replay, replay_ms))
        for s in seqs:
            engine.free(s)
        print(out[-1], flush=True)
    return out


def replay_kernels(replay, replay_ms: float, reps: int = 20) -> dict:
    """The kernels of one graph replay (a torch profile of ``reps`` replays): device time per replay summed over
    them against the replay's wall time. What is left is the chain's gaps (launch, ramp and tail of each kernel
    waiting on the one before); a table of the kernels, per replay, is printed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    busy_ms = sum(e.self_device_time_total for e in kernels) / reps / 1e3
    count = sum(e.count for e in kernels) / reps
    print(f"replay {replay_ms:.3f} ms: kernels {busy_ms:.3f} ms busy ({count:.0f} a replay), gaps "
          f"{replay_ms - busy_ms:.3f} ms ({(replay_ms - busy_ms) / max(count, 1) * 1e3:.2f} us a kernel)")
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)
    for e in top[:16]:
        print(f"  {e.self_device_time_total / reps:9.1f} us  x{e.count / reps:5.0f}  {e.key[:110]}")
    attention_ms = sum(e.self_device_time_total for e in kernels if ATTENTION_KERNELS.search(e.key)) / reps / 1e3
    return {"replay_kernel_ms": busy_ms, "replay_kernels": count, "replay_gap_ms": replay_ms - busy_ms,
            "replay_attention_ms": attention_ms,
            "replay_top": [{"us": e.self_device_time_total / reps, "count": e.count / reps, "kernel": e.key[:110]}
                           for e in top[:8]]}


ATTENTION_KERNELS = re.compile(r"_decode_kernel|_combine_kernel|rope_decode|flash", re.I)  # decode attention's own


def prefill_profile(engine, rng, n: int, length: int) -> dict:
    """One engine step over ``n`` fresh prompts of ``length`` tokens (timed), then its torch profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine import _seqs

    vocab = min(engine.model.spec.vocab_size, engine.tokenizer.vocab_size)

    def once():
        seqs = _seqs(engine, [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)], [2] * n)
        for s in seqs:
            engine.add(s)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        assert out.batch_tokens == n * length, out.batch_tokens
        for s in seqs:
            engine.free(s)
        return ms

    once()
    times = [once() for _ in range(3)]
    flops = 2 * sum(p.numel() for p in engine.model.parameters()) * n * length
    result = {"prefill_tokens": n * length, "step_ms": min(times), "tflops": flops / min(times) / 1e9}
    print(result, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    return result


def mixed_profile(engine, rng, rows: int, tokens: int, cached: int = 0) -> dict:
    """A step of ``rows`` decoding sequences plus one prompt of ``tokens`` new tokens (what a closed loop's steady
    state runs) after ``cached`` tokens already in the prefix cache (a chat turn), timed against the decode step
    alone, then its torch profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine import _seqs, decoding

    vocab = min(engine.model.spec.vocab_size, engine.tokenizer.vocab_size)
    running = decoding(engine, rows, 512, 2048, rng)

    prefix = [rng.randrange(3, vocab) for _ in range(cached)]
    if cached:  # into the prefix cache
        first = _seqs(engine, [prefix], [1])[0]
        engine.add(first)
        while not first.finished:
            engine.step()

    def once(with_prompt: bool):
        if with_prompt:
            for s in _seqs(engine, [prefix + [rng.randrange(3, vocab) for _ in range(tokens)]], [1]):
                engine.add(s)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, out.batch_tokens

    for _ in range(3):
        once(True), once(False)
    mixed = sorted(once(True) for _ in range(5))[2]
    decode = sorted(once(False) for _ in range(5))[2]
    result = {"decode_rows": rows, "prompt_tokens": tokens, "cached_tokens": cached, "mixed_step_ms": mixed[0], "mixed_step_tokens": mixed[1],
              "decode_step_ms": decode[0], "decode_step_tokens": decode[1]}
    print(result, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        once(True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print("where the small copies and elementwise launches come from (count per call site):")
    for e in sorted(prof.key_averages(group_by_stack_n=4), key=lambda e: -e.count):
        if e.key in ("aten::copy_", "aten::add", "aten::mul", "aten::cat", "aten::contiguous", "aten::to",
                     "aten::index_copy_", "aten::index", "aten::fill_", "aten::zero_") and e.count >= 16:
            print(f"  {e.key} x{e.count}: " + " <- ".join(f.split("/")[-1] for f in e.stack[:4]))
    for s in running:
        engine.free(s)
    return result


def profile_all(engine, args) -> None:
    """What ``args`` ask for: mixed steps, a prefill step, or decode steps (graph times first if asked)."""
    import random

    from torch.profiler import ProfilerActivity, profile

    from bench.engine import decode_rate

    engine.warm_up()
    print("device micro-benchmarks:", micro(engine.device), flush=True)

    rng = random.Random(0)
    if args.mixed:
        for case in args.mixed.split(","):
            mixed_profile(engine, rng, *(int(x) for x in case.split(":")))
        return
    if args.prefill:
        n, length = (int(x) for x in args.prefill.split(":"))
        prefill_profile(engine, rng, n, length)
        return
    if args.graph_times:
        graph_times(engine, rng, [int(b) for b in args.graph_times.split(",")])
    print(decode_rate(engine, args.batch, 128, args.steps, rng), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        print(decode_rate(engine, args.batch, 128, args.steps, rng), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=24))


def main(argv=None) -> int:
    from engine import EngineConfig
    from engine.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--graph-times", default="", help="batch sizes to break down into graph replay, kernel and host")
    ap.add_argument("--prefill", default="", help="N:LEN: profile one step over N fresh prompts of LEN tokens, then stop")
    ap.add_argument("--mixed", default="", help="ROWS:TOKENS[:CACHED],...: profile a step of ROWS decodes plus a prompt of "
                    "TOKENS new tokens (after CACHED in the prefix cache), then stop")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--tp", type=int, default=1, help="profile rank 0 of a tensor-parallel group (cuda:0..N-1)")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false", help="the step ahead off (A/B)")
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, device="cuda", tp=args.tp, overlap=args.overlap,
                                 max_num_seqs=max(64, args.batch), kv_budget_bytes=8 << 30,
                                 load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype, max_model_len=4096))
    try:
        profile_all(engine, args)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
