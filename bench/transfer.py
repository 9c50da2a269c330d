"""``pdserve bench transfer``: move one KV payload between two real processes
with each chosen transport and with the plain-socket reference, repetitions
interleaved (ref A B ref A B ...), warm-up excluded. The receiving process is
told which transfer to expect over a pipe, materializes it (deserialize + h2d)
and answers with its phase record; the sender's wall clock from start to that
answer is the independent total the phases are checked against."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import sys
import time

from .payload import PRESETS, layout_from_args, make_kv
from .report import write_reports
from .stats import summary

REFERENCE = "reference"


def add_arguments(p):
    p.add_argument("--preset", default="mistral-7b@871", help=f"one of {sorted(PRESETS)}")
    p.add_argument("--layers", type=int, default=0, help="custom shape instead of a preset")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=871)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--transports", default="tcp", help="comma-separated transport names")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--link", default="loopback", help="loopback")
    p.add_argument("--out", default="bench/out/transfer", help="report path prefix (.json/.md/.png)")


def _options(names, role: str, hostfile: str | None) -> dict:
    if "mlx" in names:
        return {"mlx_hostfile": hostfile, "mlx_rank": 0 if role == "sender" else 1}
    return {}


def _receiver_main(conn, names, layout_dict, nbytes, hostfile):
    from kvtransfer import TransportConfig, make_receiver
    from kvtransfer.tensors import materialize

    from .reference import RawReceiver

    cfg = TransportConfig(max_transfer_bytes=max(nbytes, 1) * 2, pool_bytes=nbytes * 4, timeout_s=120,
                          options=_options(names, "receiver", hostfile))
    receivers = {n: make_receiver(n, cfg) for n in names}
    for r in receivers.values():
        r.start()
    raw = RawReceiver(nbytes)
    conn.send({n: r.address for n, r in receivers.items()} | {REFERENCE: raw.address})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, tid = msg
        got = receivers[name].wait(tid, 120)
        materialize(got, "cpu")
        got.release()
        conn.send(got.phases.to_dict())
    for r in receivers.values():
        r.close()
    raw.close()


def measure(names, layout, reps, warmup):
    from kvtransfer import TransportConfig, make_sender

    hostfile = None
    if "mlx" in names:
        import tempfile

        from deploy.up import free_port

        fd, hostfile = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]], f)

    kv = make_kv(layout)
    flat = b"".join(bytes(t.reshape(-1).view(__import__("torch").uint8).numpy()) for pair in kv for t in pair)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, names, layout.to_dict(), layout.total_nbytes, hostfile),
                       daemon=True)
    proc.start()
    try:
        cfg = TransportConfig(timeout_s=120, options=_options(names, "sender", hostfile))
        senders = {n: make_sender(n, cfg) for n in names}
        addresses = parent.recv()
        from .reference import RawSender

        raw = RawSender(addresses[REFERENCE])
        samples = {n: [] for n in [REFERENCE, *names]}
        for rep in range(warmup + reps):
            wall = raw.send(flat)
            if rep >= warmup:
                samples[REFERENCE].append({"wall": wall * 1e3})
            for n in names:
                tid = f"{n}-{rep}"
                parent.send((n, tid))
                start = time.perf_counter()
                senders[n].send(addresses[n], tid, layout, kv)
                phases = parent.recv()
                wall = (time.perf_counter() - start) * 1e3
                if rep >= warmup:
                    samples[n].append({**phases, "wall": wall})
        parent.send(None)
        raw.close()
        for s in senders.values():
            s.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return samples


def summarize(samples, nbytes):
    ref_ms = summary(s["wall"] for s in samples[REFERENCE])["median"]
    out = {}
    for name, rows in samples.items():
        wall = summary(r["wall"] for r in rows)
        entry = {"wall_ms": wall, "gbps": nbytes * 8 / (wall["median"] * 1e6), "pct_of_reference": 100 * ref_ms / wall["median"]}
        if name != REFERENCE:
            for phase in ("d2h", "serialize", "wire", "deserialize", "h2d", "total"):
                entry[f"{phase}_ms"] = summary(r[phase] for r in rows)
            entry["phase_sum_vs_wall_pct"] = 100 * entry["total_ms"]["median"] / wall["median"]
            entry["ser_deser_pct_of_wire"] = 100 * (entry["serialize_ms"]["median"] + entry["deserialize_ms"]["median"]) / entry["wire_ms"]["median"]
        out[name] = entry
    return out


def environment() -> dict:
    import torch

    try:
        commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    except OSError:
        commit = ""
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "commit": commit}


def run(args) -> int:
    if args.link != "loopback":
        print(f"link {args.link!r} is not supported yet; use loopback", file=sys.stderr)
        return 2
    layout = layout_from_args(args)
    names = [n for n in args.transports.split(",") if n]
    print(f"payload {layout.total_nbytes / 1e6:.1f} MB ({args.preset if not args.layers else 'custom'}), "
          f"transports {names} vs {REFERENCE}, {args.reps} reps after {args.warmup} warm-up", flush=True)
    ray_cluster = None
    if "ray" in names and not os.environ.get("RAY_ADDRESS"):
        from deploy.raycluster import RayCluster

        ray_cluster = RayCluster(num_cpus=2, token=os.environ.get("RAY_AUTH_TOKEN")).start()
        os.environ.update(ray_cluster.env)
    try:
        samples = measure(names, layout, args.reps, args.warmup)
    finally:
        if ray_cluster:
            ray_cluster.stop()
    report = {"command": " ".join(["pdserve", "bench", "transfer", *sys.argv[3:]]), "layout": layout.to_dict(),
              "bytes": layout.total_nbytes, "link": args.link, "env": environment(),
              "summary": summarize(samples, layout.total_nbytes), "samples": samples}
    paths = write_reports(report, args.out)
    print(paths["markdown_text"])
    print("wrote " + ", ".join(v for k, v in paths.items() if k != "markdown_text"))
    return 0
