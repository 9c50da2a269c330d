"""What a KV copy between a paged pool and one canonical buffer costs as the
sequence's blocks fall into more runs: the list of views (a ``cat`` on the
sender, a ``_foreach_copy_`` on the receiver: views made, checked and copied
one per run, layer and side) against ``PoolRows`` (one indexed copy per layer
and side). Wall time per copy, synchronized, the Python in it included: the
time a transfer thread holds the GIL while the engine's thread waits.

  python -m bench.lab.pool_rows [--device cuda] [--tokens 7040] [--heads 8] [--dim 128] [--out bench/results/pool-rows]

Defaults to the Mistral-7B geometry (32 layers, 8 KV heads of 128, bf16) on
the GPU; on a CPU give small ``--heads``/``--dim`` so the bytes do not hide
the per-run cost. A second table runs ``BlockManager`` through churn (the
long workload's 6-8k-token prompts and 128-256 outputs, the prefix cache
on) and counts the runs of each new sequence's blocks."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from engine.blocks import BlockManager
from engine.kv_pool import KVPool
from kvtransfer import KVLayout, PiecewiseKV, PoolRows
from kvtransfer.transports.nccl.ops import gather, scatter


def table_of(blocks: int, runs: int) -> list[int]:
    """``blocks`` block ids in ``runs`` runs of about equal length, a gap between runs."""
    size, table, at = -(-blocks // runs), [], 0
    while len(table) < blocks:
        table += list(range(at, at + min(size, blocks - len(table))))
        at += size + 1
    return table


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_copy(pool, table, tokens, kind: str, repeats: int) -> float:
    """Median ms of one gather + one scatter of the sequence's KV through a canonical buffer."""
    device = pool.layers[0][0].device
    layout = KVLayout(len(pool.layers), pool.kv_heads, pool.head_dim, tokens, "bfloat16")
    buffer = torch.empty(layout.total_nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        layers = PoolRows(*pool_rows(pool, table, tokens), index_above=0) if kind == "rows" else pool.pieces(table, tokens)
        kv = PiecewiseKV(layout, layers).check()
        gather(kv.layers, buffer, layout)
        scatter(buffer, kv.layers, layout)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def pool_rows(pool, table, tokens):
    return pool.flat, pool.spans(table, tokens)


def churn(blocks: int, sequences: int, seed: int = 0) -> list[int]:
    """Runs of each new long sequence's blocks as sequences come and go through a caching pool."""
    rng, manager, live, out, key = random.Random(seed), BlockManager(blocks, 16, caching=True), [], [], 0
    for _ in range(sequences):
        tokens, table = rng.randint(6000, 8000), []
        manager.grow(table, tokens)
        out.append(1 + sum(1 for a, b in zip(table, table[1:]) if b != a + 1))
        live.append([table, tokens, rng.randint(128, 256)])
        for seq in list(live):
            step = min(seq[2], 30)
            seq[1], seq[2] = seq[1] + step, seq[2] - step
            manager.grow(seq[0], seq[1])
            for block in seq[0][:seq[1] // 16]:
                key += 1
                manager.register(block, key)
            if seq[2] == 0:
                live.remove(seq)
                manager.release(seq[0])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=7040)
    ap.add_argument("--runs", default="1,8,32,128,440")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, blocks = torch.device(args.device), -(-args.tokens // 16)
    pool = KVPool(args.layers, 2 * blocks + 1, 16, args.heads, args.dim, torch.bfloat16, device)
    rows = []
    for runs in (int(r) for r in args.runs.split(",")):
        table = table_of(blocks, runs)
        rows.append({"runs": runs, **{f"{kind}_ms": round(time_copy(pool, table, args.tokens, kind, args.repeats), 3)
                                      for kind in ("views", "rows")}})
        print(f"{runs:4d} runs: views {rows[-1]['views_ms']:8.2f} ms, rows {rows[-1]['rows_ms']:8.2f} ms", flush=True)
    runs_seen = churn(30275, 400)
    quarters = [round(statistics.mean(runs_seen[i:i + 100]), 1) for i in range(0, 400, 100)]
    print(f"runs per new 6-8k-token sequence through churn, by hundred: {quarters}")
    report = {"command": "python -m bench.lab.pool_rows " + " ".join(sys.argv[1:] if argv is None else argv), "device": str(device),
              "geometry": {"layers": args.layers, "heads": args.heads, "dim": args.dim, "tokens": args.tokens},
              "copies": rows, "churn_runs_by_hundred": quarters}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"`{report['command']}` on {device}: {args.layers} layers x {args.heads} heads x {args.dim}, "
                    f"{args.tokens} tokens, bf16. One gather + one scatter through a canonical buffer, ms (median).\n\n"
                    "| runs | list of views | PoolRows (by index) |\n|---|---|---|\n")
            f.writelines(f"| {r['runs']} | {r['views_ms']} | {r['rows_ms']} |\n" for r in rows)
            f.write(f"\nBlockManager through churn (30,275 blocks, prefix cache on): runs per new 6-8k-token "
                    f"sequence, by hundred sequences: {quarters}\n")


if __name__ == "__main__":
    main()
