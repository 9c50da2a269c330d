"""Conformance and speed of the nccl transport on a two-GPU machine.

    python -m bench.nccl_check [--out results.json] [--backend gloo] [--no-eager] [--direct-cuts N] [--same-gpu]

Rank 0 (prefill, cuda:0) sends, rank 1 (decode, cuda:1; cuda:0 too with ``--same-gpu``, where the transport copies
through CUDA IPC and the raw reference is a device copy within one process) receives. Checks
bit-exact round trips (fp32/fp16/bf16, 1 and 80 layers, 1..4096 tokens, odd
and non-contiguous shapes), 8 transfers in flight, abort (before BEGIN, and as the KV lands: ``nccl_blocks``), the size limit;
then times the 109 MB Mistral-7B KV (and two larger ones) through the transport (wall clock from the
sender's ``send`` call to the receiver holding the result; one host, one clock) against a raw
``dist.send``/``dist.recv`` of the same bytes in the same run: produced in the sender's own
GPU slab (``alloc``, as the prefill engine does) and, for Mistral, also as separate
tensors the sender must gather first ("/staged") and from the blocks of a paged pool into the blocks of another
("/blocks", what the workers do)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.launch import held_store, store_client

from .nccl_blocks import (in_pool, kv, land_in_blocks, mid_abort_received, mid_abort_sent, receive_pieces, same,
                          send_pieces)

CASES = [(1, 1, 1, 1), (1, 8, 4096, 128), (80, 2, 3, 8), (3, 5, 1000, 7)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PAYLOADS = {"mistral-7b@871": (32, 8, 871, 128, torch.float16),
            "mistral-7b@871/blocks": (32, 8, 871, 128, torch.float16),
            "mistral-7b@871/staged": (32, 8, 871, 128, torch.float16),
            "llama3-8b@4096": (32, 8, 4096, 128, torch.float16),
            "llama3-70b@8192": (80, 8, 8192, 128, torch.bfloat16)}
REPS = 20
ROUNDS = 4
CPU_PAYLOADS = {"small": (4, 2, 64, 16, torch.float16), "small/staged": (4, 2, 64, 16, torch.float16),
                "small/blocks": (4, 2, 64, 16, torch.float16)}


_copy_source: dict = {}


def source_of_copy(sink: torch.Tensor) -> torch.Tensor:
    if sink.numel() not in _copy_source:
        _copy_source.clear()
        _copy_source[sink.numel()] = torch.empty_like(sink)
    return _copy_source[sink.numel()]


def in_flight():
    """8 senders at once, each sending ROUNDS KVs of its own sizes, placed and staged alternately."""
    return [(i, j) for j in range(ROUNDS) for i in range(8)]


def in_flight_shape(i, j):
    return (2, 4, 64 + i + 8 * j, 32)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank, store_port, results, backend="nccl", eager=True, direct_cuts=0, same_gpu=False):
    """Rank ``rank`` of the check; ``store_port``: the store the parent holds (rank 1 names its KV address there)."""
    from kvtransfer import KVLayout, TransferError, TransportConfig, make_receiver, make_sender
    from kvtransfer.tensors import layout_of, materialize

    device = torch.device(f"cuda:{0 if same_gpu else rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # this check's own world (barriers, the raw baseline; gloo for two processes on one GPU, which NCCL refuses);
    # the transport forms its pair by itself
    world = "gloo" if same_gpu else backend
    store = store_client(store_port)
    dist.init_process_group(world, store=store, rank=rank, world_size=2,
                            **({"device_id": device} if world == "nccl" else {}))
    payloads, reps = (PAYLOADS, REPS) if backend == "nccl" else (CPU_PAYLOADS, 4)
    cfg = TransportConfig(port=0, timeout_s=60, max_transfer_bytes=4 << 30,
                          options={"device": str(device), "nccl_backend": backend, "nccl_eager": eager,
                                   "nccl_direct_cuts": direct_cuts,
                                   "nccl_pool_bytes": (3 << 30) if backend == "nccl" else (64 << 20)})
    jobs = [(f"{s}-{d}", s, d, False) for s in CASES for d in DTYPES] + [("strided", (4, 3, 33, 16), torch.bfloat16, True)]
    if rank == 1:
        r = make_receiver("nccl", cfg)
        blocks = land_in_blocks(r, device)
        r.start()
        store.set("kv_addr", r.address)
        dist.barrier()
        report = {"checks": {}, "payloads": {}}
        for i, (name, shape, dtype, strided) in enumerate(jobs):
            got = r.wait(name, 60)
            layers = materialize(got, device)
            want = kv(shape, dtype, i, device, strided)
            report["checks"][name] = all(torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))
                                         for pa, pb in zip(want, layers) for a, b in zip(pa, pb))
            got.release()
        ok8 = True
        for i, j in in_flight():
            got = r.wait(f"c{i}-{j}", 60)
            ok8 &= same(kv(in_flight_shape(i, j), torch.float16, 100 + 8 * j + i, device), materialize(got, device))
            got.release()
        report["checks"]["8_in_flight"] = ok8
        got = r.wait("placed", 60)
        report["checks"]["placed"] = same(kv((6, 2, 37, 8), torch.bfloat16, 55, device), materialize(got, device))
        got.release()
        report["checks"].update(receive_pieces(r, blocks, device))
        r.abort("aborted")
        dist.barrier()
        dist.barrier()
        got = r.wait("after-abort", 60)
        report["checks"]["after_abort"] = same(kv((6, 2, 37, 8), torch.bfloat16, 56, device), materialize(got, device))
        got.release()
        try:
            r.wait("aborted", 5)
            report["checks"]["abort"] = False
        except TransferError:
            report["checks"]["abort"] = True
        report["checks"].update(mid_abort_received(r, device))
        report["drained"], report["scattered_bytes"] = r.drained, r.scattered_bytes
        dist.barrier()
        for name, (L, H, T, D, dtype) in payloads.items():
            transport, raw = [], []
            nbytes = KVLayout(L, H, D, T, str(dtype).split(".")[1]).total_nbytes
            sink = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for rep in range(reps + 2):
                dist.barrier()
                got = r.wait(f"{name}-{rep}", 60)
                sync(device)
                if rep == 0 and name.endswith("/blocks"):
                    report["checks"][name] = got.landed is not None and same(kv((L, H, T, D), dtype, 7, device),
                                                                             got.landed.whole())
                if rep >= 2:
                    transport.append({**got.phases.to_dict(), "wall": (got.completed_at - got.meta["sent_at"]) * 1e3})
                got.release()
                dist.barrier()
                t0 = time.perf_counter()
                if same_gpu:  # the reference for a copy through an IPC mapping: a copy within one process
                    sink.copy_(source_of_copy(sink))
                else:
                    dist.recv(sink, 0)
                sync(device)
                dist.barrier()
                if rep >= 2:
                    raw.append((time.perf_counter() - t0) * 1e3)
            med, raw_med = statistics.median(p["wall"] for p in transport), statistics.median(raw)
            phases = {k: statistics.median(p[k] for p in transport) for k in ("d2h", "serialize", "wire", "deserialize", "h2d", "total")}
            report["payloads"][name] = {
                "bytes": nbytes, "transport_wall_ms": med, "raw_nccl_ms": raw_med,
                "transport_GBps": nbytes / med / 1e6, "raw_GBps": nbytes / raw_med / 1e6,
                "pct_of_raw": 100 * raw_med / med, "phase_sum_over_wall": phases["total"] / med,
                "phases_median_ms": phases}
            del sink
        report["pool"] = {"allocations": r.pool.allocations, "reuses": r.pool.reuses}
        report["ipc_receives"] = r.ipc_receives  # counted, as the sender's ipc_sends, after the timed payloads too
        dist.barrier()
        report["hangup"] = hung_up_sender_fails_fast(r)
        results.update(report)
        r.close()
    else:
        s = make_sender("nccl", cfg)
        dist.barrier()
        dest = store.get("kv_addr").decode()
        for i, (name, shape, dtype, strided) in enumerate(jobs):
            layers = kv(shape, dtype, i, device, strided)
            s.send(dest, name, layout_of(layers), layers)
        def stream(i):
            for j in range(ROUNDS):
                layers = kv(in_flight_shape(i, j), torch.float16, 100 + 8 * j + i, device)
                if (i + j) % 2:
                    layers = s.alloc(layout_of(layers), str(device)).fill(layers)
                s.send(dest, f"c{i}-{j}", layout_of(layers), layers)
                getattr(layers, "release", lambda: None)()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        want = kv((6, 2, 37, 8), torch.bfloat16, 55, device)
        source, before = s.alloc(layout_of(want), str(device)).fill(want), s.staged_bytes
        s.send(dest, "placed", layout_of(want), source.layers)
        source.release()
        results["placed_staged_bytes"] = s.staged_bytes - before
        results["pieces_staged_bytes"] = send_pieces(s, dest, device)
        dist.barrier()
        dist.barrier()
        results.update(mid_abort_sent(s, dest, device))
        for name, seed in (("aborted", 55), ("after-abort", 56)):
            source = s.alloc(layout_of(want), str(device)).fill(kv((6, 2, 37, 8), torch.bfloat16, seed, device))
            try:
                s.send(dest, name, source.layout, source)
                results[f"{name}_sent"] = True
            except TransferError:
                results[f"{name}_sent"] = False
            source.release()
        huge = KVLayout(1024, 64, 256, 8192, "float32")
        try:
            s.send(dest, "huge", huge, iter([]))
            refused = False
        except TransferError:
            refused = True
        results["size_limit_refused"] = refused
        dist.barrier()
        for name, (L, H, T, D, dtype) in payloads.items():
            layers = kv((L, H, T, D), dtype, 7, device)
            source = None if name.endswith(("/staged", "/blocks")) else s.alloc(layout_of(layers), str(device))
            if source is not None:
                layers = source.fill(layers)
            layout = layout_of(layers)
            if name.endswith("/blocks"):
                layers = in_pool(layers, device)
            flat = torch.empty(layout.total_nbytes, dtype=torch.uint8, device=device)
            for rep in range(reps + 2):
                dist.barrier()
                s.send(dest, f"{name}-{rep}", layout, layers, meta={"sent_at": time.perf_counter()})
                dist.barrier()
                if not same_gpu:
                    dist.send(flat, 1)
                sync(device)
                dist.barrier()
            if source is not None:
                source.release()
            del layers, flat
        results["eager_sends"], results["gathered_bytes"] = s.eager_sends, s.gathered_bytes
        results["piece_sends"], results["ipc_sends"] = s.piece_sends, s.ipc_sends
        key = s.pairs.for_dest(dest)[0].key
        kept, s.pairs = s.pairs, None  # the pair's group stays up (closing would close it): a sender that hangs up
        s.close()
        dist.barrier()
        begin_then_hang_up(dest, KVLayout(2, 2, 8, 16, "float16"), key)
    # the hang-up left the pair unusable (the receiver aborted it); this check's own world is done too
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    if backend == "gloo" or same_gpu:
        os._exit(0)  # gloo cannot abort the receive the hang-up left pending; its destructor would terminate()


def begin_then_hang_up(dest, layout, pair: str):
    """A sender that dies between its eager BEGIN and its send: the receiver has posted a recv
    that nothing will ever match."""
    from kvtransfer import frames
    host, port = dest.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(frames.meta_frame(frames.BEGIN, {"tid": "hangup", "layout": layout.to_dict(), "meta": {}, "eager": True,
                                                       "pair": pair}))
        time.sleep(0.5)


def hung_up_sender_fails_fast(r) -> dict:
    from kvtransfer import TransferError
    from kvtransfer.transports.nccl import pairs as nccl_pairs
    start = time.monotonic()
    try:
        r.wait("hangup", 30)
        failed = False
    except (TransferError, TimeoutError):
        failed = True
    return {"reported_error": failed, "seconds": time.monotonic() - start, "world": list(nccl_pairs.broken)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nccl_check.json")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                    help="gloo: the same protocol between two CPU processes (no GPUs needed; timings mean little)")
    ap.add_argument("--no-eager", dest="eager", action="store_false", help="a GRANT round trip for every transfer")
    ap.add_argument("--direct-cuts", type=int, default=0,
                    help="move KV in pieces (no gather/scatter) when it cuts into at most this many segments per layer")
    ap.add_argument("--same-gpu", action="store_true",
                    help="both ranks on cuda:0: the transport's CUDA IPC path for pairs NCCL refuses")
    args = ap.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < (1 if args.same_gpu else 2):
        raise SystemExit("needs two CUDA GPUs (one with --same-gpu; or --backend gloo)")
    manager = mp.Manager()
    results = manager.dict()
    store = held_store()  # held here while the ranks run: no port is named before it is bound
    mp.spawn(worker, args=(store.port, results, args.backend, args.eager, args.direct_cuts, args.same_gpu),
             nprocs=2, join=True)
    out = dict(results)
    out["backend"], out["eager"], out["direct_cuts"] = args.backend, args.eager, args.direct_cuts
    out["same_gpu"] = args.same_gpu
    if args.backend == "nccl":
        out["gpus"] = [torch.cuda.get_device_name(0 if args.same_gpu else i) for i in range(2)]
    out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
