"""Where a decode step's time goes, on a GPU machine: launch and sync costs of the device, then a torch profile
of a few batched decode steps (top operators by CPU and device time).

    python -m bench.profile_engine --model DIR [--batch 32] [--steps 8]"""
from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine import decode_rate
    from engine import EngineConfig
    from engine.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, device="cuda", max_num_seqs=max(64, args.batch), kv_budget_bytes=8 << 30))
    print("device micro-benchmarks:", micro(engine.device), flush=True)
    import random

    rng = random.Random(0)
    print(decode_rate(engine, args.batch, 128, args.steps, rng), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        print(decode_rate(engine, args.batch, 128, args.steps, rng), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
