"""Two key-value stores as a cluster-wide pool for KV-cache blocks, A/B on one machine:

- ``ray``: the Ray object store. A named detached actor keeps ``{key: [ObjectRef]}``; a writer ``ray.put``s each
  block and registers the refs, a reader asks the actor for a batch of refs and ``ray.get``s them.
- ``mooncake``: Mooncake Store (``mooncake_master`` with its embedded HTTP metadata server) with embedded clients
  (``setup``, TCP): ``batch_put_from`` / ``batch_is_exist`` / ``batch_get_into`` on registered buffers. The writer
  mounts the segment that holds the blocks; the reader mounts none and reads them over TCP from the writer.
- ``mooncake-daemon``: the same store with one ``mooncake_client`` process for the host that mounts the segment;
  the workers are its dummy clients (``setup_dummy``), their buffers in a shared-memory pool
  (``alloc_from_mem_pool``), so blocks move by memcpy and outlive the worker that wrote them.

    python -m bench.lab.kv_store --stores ray,mooncake,mooncake-daemon --block-bytes 2097152,65536 --blocks 256 --out /tmp/kv-store.json

A block is a contiguous byte buffer (2 MiB: one 16-token block of an 8B model in bf16; 64 KiB: a small one), its
key a random 64-bit integer (its decimal string for Mooncake). For each store, block size and run, a writer process
puts ``--blocks`` seeded random blocks in batches of ``--batch`` (after one warm-up put) and stays alive; then a
reader process, a separate OS process on the same cluster as a second serving worker would be, measures:

- existence of a batch of 64 keys: ms per call, median and p90 of ``--repeats`` calls after one warm-up;
- time to first byte: ms from asking for one block (the index look-up included) to holding its bytes in the
  reader's own buffer, median of 8 blocks after one warm-up;
- get GB/s (1e9 bytes/s): every block into the reader's own buffer, batch by batch, compared bit-exactly with the
  seeded bytes afterwards. Ray's ``ray.get`` maps the object read-only (zero-copy), so its figure includes the copy
  into the reader's buffer, and ``get_mapped_gbps`` gives it without that copy;
- whether a block is still readable after the writer process has closed and exited (what a pool needs when
  workers come and go): Ray frees an object with its owner, the writer; so does Mooncake with a mounted segment.

Put GB/s is the writer's, from the first batch to the last one registered. Each configuration runs ``--runs``
times (fresh writer and reader processes, fresh keys); every run is reported. The script starts the servers it
needs (a local Ray cluster advertising 127.0.0.1; ``mooncake_master`` bound to 127.0.0.1 on free ports) and stops
them at the end, errors included. A store that cannot run is reported with its error instead of figures.

Mooncake needs ``pip install mooncake-transfer-engine-non-cuda`` (the plain ``mooncake-transfer-engine`` wheel
links libcuda.so.1 and libcudart.so.12: without an NVIDIA driver ``mooncake.store`` does not import) and the
system's libibverbs.so.1 (Debian: ``apt-get install libibverbs1``), RDMA hardware or not. Figures on a shared
2-core machine move with its load (each row gives the 1-minute load average); a run's first put into a segment
also pays for the first touch of its pages."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import numpy as np

from .kv_store_clients import CLIENTS
from .kv_store_servers import mooncake_daemon, mooncake_master, ray_cluster

log = logging.getLogger("bench.lab.kv_store")
EXIST_KEYS, TTFB_BLOCKS = 64, 8
TIMEOUT_S = 600.0


# -- data ------------------------------------------------------------------------------------------------------

def blocks_of(seed: int, blocks: int, block_bytes: int) -> tuple[list[int], np.ndarray, int]:
    """``blocks`` distinct random 63-bit keys, as many random blocks (one row each) and one more key (the writer's
    warm-up put); the same for the same seed."""
    rng = np.random.default_rng(seed)
    keys = list(dict.fromkeys(int(k) for k in rng.integers(1, 2**63 - 1, size=2 * blocks + 2, dtype=np.int64)))
    data = np.frombuffer(bytearray(rng.bytes(blocks * block_bytes)), dtype=np.uint8).reshape(blocks, block_bytes)
    return keys[:blocks], data, keys[blocks]


def batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def ms_stats(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"p50": round(statistics.median(ms), 3), "p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3),
            "n": len(ms)}


# -- the two processes ----------------------------------------------------------------------------------------

def child_setup(spec: dict) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    os.environ.update(spec.get("client_env", {}))


def writer(spec: dict, conn) -> None:
    """Puts the blocks (after one warm-up put under a key of its own), reports, and keeps them (it owns them) until
    the parent says to exit."""
    child_setup(spec)
    try:
        keys, seeded, spare = blocks_of(spec["seed"], spec["blocks"], spec["block_bytes"])
        start = time.perf_counter()
        client = CLIENTS[spec["store"]](spec, "writer")
        connect_s = time.perf_counter() - start
        data = client.buffer(seeded.shape)
        data[:] = seeded
        client.put([spare], data[:1])
        start = time.perf_counter()
        for part in batches(len(keys), spec["batch"]):
            client.put(keys[part], data[part])
        put_s = time.perf_counter() - start
        conn.send({"connect_s": round(connect_s, 3), "put_s": put_s, "put_gbps": round(data.nbytes / put_s / 1e9, 3)})
        conn.recv()
        client.close()
    except Exception:
        conn.send({"error": traceback.format_exc()})


def reader(spec: dict, conn) -> None:
    """Existence checks, single-block gets, then every block; bit-exact check; then a read after the writer exited."""
    child_setup(spec)
    try:
        keys, expected, _ = blocks_of(spec["seed"], spec["blocks"], spec["block_bytes"])
        start = time.perf_counter()
        client = CLIENTS[spec["store"]](spec, "reader")
        result = {"connect_s": round(time.perf_counter() - start, 3)}
        out = client.buffer(expected.shape)
        result.update(exist_and_ttfb(client, keys, out, spec["repeats"]))
        client.copy_s = 0.0
        start = time.perf_counter()
        for part in batches(len(keys), spec["batch"]):
            client.get_into(keys[part], out[part])
        get_s = time.perf_counter() - start
        result.update(get_gbps=round(out.nbytes / get_s / 1e9, 3), get_s=get_s,
                      bad_blocks=int(sum(not np.array_equal(o, e) for o, e in zip(out, expected))))
        if client.copy_s:
            result["get_mapped_gbps"] = round(out.nbytes / (get_s - client.copy_s) / 1e9, 3)
        result["bit_exact"] = result["bad_blocks"] == 0
        conn.send(result)
        conn.recv()
        conn.send({"survives_writer_exit": survives(client, keys[0], out[:1], expected[0])})
        client.clear()
        client.close()
    except Exception:
        conn.send({"error": traceback.format_exc()})


def exist_and_ttfb(client, keys: list[int], out: np.ndarray, repeats: int) -> dict:
    batch = keys[:EXIST_KEYS]
    if not all(client.exist(batch)):
        raise RuntimeError("a written key is not there")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        client.exist(batch)
        times.append(time.perf_counter() - start)
    single = list(range(len(keys)))[-(TTFB_BLOCKS + 1):]
    ttfb = []
    for i in single:
        start = time.perf_counter()
        client.get_into([keys[i]], out[i:i + 1])
        ttfb.append(time.perf_counter() - start)
    return {"exist64_ms": ms_stats(times), "ttfb_ms": ms_stats(ttfb[1:]), "ttfb_first_ms": round(ttfb[0] * 1e3, 3)}


def survives(client, key: int, out: np.ndarray, expected: np.ndarray) -> bool:
    try:
        if not client.exist([key])[0]:
            return False
        out[:] = 0
        client.get_into([key], out)
        return bool(np.array_equal(out[0], expected))
    except Exception as e:
        log.info("after the writer exited: %s: %.100s", type(e).__name__, str(e).split("\n")[0])
        return False


def receive(conn, proc, role: str) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"{role} exited with code {proc.exitcode} before answering")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role}: no answer in {TIMEOUT_S:.0f} s")
    message = conn.recv()
    if "error" in message:
        raise RuntimeError(f"{role} failed:\n{message['error']}")
    return message


def run_pair(spec: dict) -> dict:
    """One writer process, then one reader process; both ended here whatever happens."""
    ctx, procs = mp.get_context("spawn"), []
    try:
        w_conn, w_child = ctx.Pipe()
        procs.append(ctx.Process(target=writer, args=(spec, w_child), name=f"{spec['store']}-writer"))
        procs[-1].start()
        written = receive(w_conn, procs[0], "writer")
        r_conn, r_child = ctx.Pipe()
        procs.append(ctx.Process(target=reader, args=(spec, r_child), name=f"{spec['store']}-reader"))
        procs[-1].start()
        read = receive(r_conn, procs[1], "reader")
        w_conn.send("exit")
        procs[0].join(60)
        r_conn.send("writer exited")
        read.update(receive(r_conn, procs[1], "reader"))
        procs[1].join(60)
        return {"writer": written, "reader": read}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            if proc.is_alive():
                proc.kill()


def versions() -> dict:
    found = {}
    for dist in ("ray", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


# -- the A/B --------------------------------------------------------------------------------------------------

def measure(store: str, server: dict, args, sizes: list[int], rows: list[dict]) -> None:
    """Appends one row per block size and run to ``rows`` (those done stay there if a later one fails)."""
    for size_index, block_bytes in enumerate(sizes):
        for run in range(args.runs):
            spec = {"store": store, "block_bytes": block_bytes, "blocks": args.blocks, "batch": args.batch,
                    "repeats": args.repeats, "seed": args.seed + 1000 * run + size_index, **server}
            log.info("%s, %d blocks of %d bytes, run %d", store, args.blocks, block_bytes, run + 1)
            load = os.getloadavg()[0]
            rows.append(dict(row_of(store, block_bytes, run + 1, args.blocks, run_pair(spec)), load1=round(load, 2)))


def row_of(store: str, block_bytes: int, run: int, blocks: int, pair: dict) -> dict:
    w, r = pair["writer"], pair["reader"]
    row = {"store": store, "block_bytes": block_bytes, "blocks": blocks, "run": run,
           "put_gbps": w["put_gbps"], "get_gbps": r["get_gbps"], "exist64_ms": r["exist64_ms"],
           "ttfb_ms": r["ttfb_ms"], "ttfb_first_ms": r["ttfb_first_ms"], "bit_exact": r["bit_exact"],
           "bad_blocks": r["bad_blocks"], "survives_writer_exit": r["survives_writer_exit"],
           "connect_s": {"writer": w["connect_s"], "reader": r["connect_s"]}}
    if "get_mapped_gbps" in r:
        row["get_mapped_gbps"] = r["get_mapped_gbps"]
    return row


def table(rows: list[dict], errors: dict) -> str:
    lines = ["| store | block | run | put GB/s | get GB/s | exist 64 keys ms p50 (p90) | TTFB ms p50 (p90) | "
             "bit-exact | survives writer exit | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        get = f"{r['get_gbps']}" + (f" ({r['get_mapped_gbps']} mapped)" if "get_mapped_gbps" in r else "")
        lines.append(f"| {r['store']} | {r['block_bytes'] // 1024} KiB | {r['run']} | {r['put_gbps']} | {get} | "
                     f"{r['exist64_ms']['p50']} ({r['exist64_ms']['p90']}) | {r['ttfb_ms']['p50']} "
                     f"({r['ttfb_ms']['p90']}) | {'yes' if r['bit_exact'] else 'NO'} | "
                     f"{'yes' if r['survives_writer_exit'] else 'no'} | {r['load1']} |")
    lines += [f"\n{store}: did not run: {msg.strip().splitlines()[-1]}" for store, msg in errors.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.kv_store", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="ray,mooncake,mooncake-daemon", help=", ".join(CLIENTS))
    ap.add_argument("--block-bytes", default="2097152,65536")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="blocks per put and per get call")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20, help="timed existence checks per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON report; without it the JSON goes to stdout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sizes, stores = [int(s) for s in args.block_bytes.split(",")], args.stores.split(",")
    if unknown := [s for s in stores if s not in CLIENTS]:
        ap.error(f"unknown store {unknown}: choose from {', '.join(CLIENTS)}")
    if args.blocks < max(EXIST_KEYS, TTFB_BLOCKS + 1):
        ap.error(f"--blocks must be at least {max(EXIST_KEYS, TTFB_BLOCKS + 1)}")
    total = args.blocks * max(sizes)
    segment = total * 5 // 4 + (64 << 20)  # below the master's eviction mark (90% full)
    servers = {"ray": lambda: ray_cluster(max(1 << 30, 2 * total)),
               "mooncake": lambda: mooncake_master(segment, 64 << 20),
               "mooncake-daemon": lambda: mooncake_daemon(segment, total + (64 << 20))}
    rows, errors, setups = [], {}, {}
    for store in stores:
        try:
            with servers[store]() as server:
                setups[store] = {k: v for k, v in server.items() if k != "ray_address"}
                measure(store, server, args, sizes, rows)
        except Exception as e:
            log.error("%s did not run: %s", store, e)
            errors[store] = str(e)
    report = {"command": "python -m bench.lab.kv_store " + " ".join(sys.argv[1:] if argv is None else argv),
              "host": {"cpus": os.cpu_count(), "platform": sys.platform, "load_average": os.getloadavg()},
              "versions": versions(),
              "units": "GB/s = 1e9 bytes/s; ms wall time in the reader or writer process",
              "setup": setups, "results": rows, "errors": errors}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    else:
        print(json.dumps(report, indent=1))
    print(table(rows, errors))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
