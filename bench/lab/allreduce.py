"""All-reduce latency for tensor parallelism's sizes, NCCL against a one-shot all-reduce over symmetric memory.

    python -m bench.lab.allreduce [--gpus 2] [--out bench/results/allreduce-2xh200]

A decode step of a TP group all-reduces twice per layer a ``[batch, hidden]`` bf16 tensor (16 KiB at batch 1 of
a 8192-wide model); this times ``torch.distributed.all_reduce`` (NCCL, NVLink multicast off) and, where this
torch has it, ``torch.ops.symm_mem.one_shot_all_reduce`` (each rank reads every peer's buffer over NVLink through
CUDA IPC, one kernel) and ``two_shot_all_reduce_`` (each rank reduces its share, then gathers the others': half
the bytes read, two barriers), each as the mean of 200 calls captured in a CUDA graph (how decode runs them)."""
from __future__ import annotations

import argparse
import json
import os
import sys

SIZES = [(1, 4096), (32, 4096), (1, 8192), (8, 8192), (32, 8192), (128, 8192), (1024, 8192)]


def _time_graph(fn, reps: int = 200) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def worker(rank: int, size: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    from engine.parallel.launch import store_client

    dist.init_process_group("nccl", store=store_client(port), rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    rows = []
    for batch, hidden in SIZES:
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        row = {"shape": [batch, hidden], "bytes": x.numel() * 2, "nccl_us": _time_graph(lambda: dist.all_reduce(x))}
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(batch, hidden, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
            buf.copy_(x)
            name = dist.group.WORLD.group_name
            want = x.float() * size
            got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            row["one_shot_ok"] = bool(torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2))
            row["one_shot_us"] = _time_graph(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name))
        except Exception as e:  # an older torch, or no peer access
            row["one_shot_error"] = f"{type(e).__name__}: {e}"[:200]
        try:  # reduce-scatter then all-gather over the same buffer, in place: half the bytes read a rank
            buf.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            row["two_shot_ok"] = bool(torch.allclose(buf.float(), want, rtol=2e-2, atol=2e-2))
            row["two_shot_us"] = _time_graph(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name))
        except Exception as e:  # noqa: BLE001 - not in this torch, or a size it refuses
            row["two_shot_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="bench/out/allreduce")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from engine.parallel.launch import held_store

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = held_store()  # the ranks' rendezvous, held here while they run
    port = store.port
    procs = [ctx.Process(target=worker, args=(r, args.gpus, port, queue)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    lines = ["| shape (bf16) | bytes | NCCL µs | one-shot µs | two-shot µs |", "|---|---|---|---|---|"]
    for r in rows:
        one, two = (f"{r[k + '_us']:.1f}" if k + "_us" in r else r.get(k + "_error", "-")[:60]
                    for k in ("one_shot", "two_shot"))
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['bytes']} | {r['nccl_us']:.1f} | {one} | {two} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": "python -m bench.lab.allreduce " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# All-reduce latency, {args.gpus} GPUs\n\n`python -m bench.lab.allreduce --gpus {args.gpus}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
