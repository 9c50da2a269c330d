"""The two processes of ``bench transfer``, driven over stdin/stdout with JSON lines.

    python -m bench.peers recv HOST NAMES NBYTES HOSTFILE   -> prints {"addresses": {...}}
        then per line {"name", "tid"}: waits, materializes, prints phases + perf_counter at done
    python -m bench.peers send NAMES LAYOUT HOSTFILE        -> prints {"ready": true}
        then per line {"name", "tid", "dest"}: sends, prints perf_counter at start

A transport that offers its own memory (``alloc``) gets the payload produced in
it once, as the prefill engine writes its KV there; the others send ordinary
tensors. Either way the same bytes move and are checked at the receiver's end.
``time.perf_counter`` is the system monotonic clock, shared by both processes."""
from __future__ import annotations

import json
import os
import sys
import time


def options(names, role: str, hostfile: str) -> dict:
    """Options of both peers: ``bench transfer --kv-option`` (``PDSERVE_BENCH_KV_OPTIONS``, JSON) and mlx's ranks."""
    given = json.loads(os.environ.get("PDSERVE_BENCH_KV_OPTIONS") or "{}")
    if "mlx" in names:
        return {**given, "mlx_hostfile": hostfile, "mlx_rank": 0 if role == "send" else 1}
    return given


def _private_stdout():
    """Keep fd 1 for our JSON lines; libraries that print (NIXL logs, Ray) go to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


_out = None


def say(obj) -> None:
    _out.write(json.dumps(obj) + "\n")
    _out.flush()


def recv(host: str, names: list[str], nbytes: int, hostfile: str) -> None:
    from control.auth import load_token
    from kvtransfer import TransportConfig, make_receiver
    from kvtransfer.tensors import materialize

    from .reference import RawReceiver

    cfg = TransportConfig(host=host, max_transfer_bytes=max(nbytes, 1) * 2, pool_bytes=nbytes * 4, timeout_s=120,
                          options={**options(names, "recv", hostfile), "nixl_pool_bytes": 2 * nbytes + (64 << 20)},
                          token=load_token())
    receivers = {n: make_receiver(n, cfg) for n in names}
    for r in receivers.values():
        r.start()
    raw = RawReceiver(nbytes, host)
    say({"addresses": {**{n: r.address for n, r in receivers.items()}, "reference": raw.address}})
    for line in sys.stdin:
        msg = json.loads(line)
        got = receivers[msg["name"]].wait(msg["tid"], 120)
        woke = time.perf_counter()
        materialize(got, "cpu")
        done = (got.completed_at or woke) + time.perf_counter() - woke
        got.release()
        say({"phases": got.phases.to_dict(), "done": done})
    for r in receivers.values():
        r.close()


def send(names: list[str], layout_dict: dict, hostfile: str) -> None:
    import torch

    from control.auth import load_token
    from kvtransfer import KVLayout, TransportConfig, make_sender

    from .payload import make_kv
    from .reference import RawSender

    layout = KVLayout.from_dict(layout_dict)
    kv = make_kv(layout)
    flat = b"".join(bytes(t.reshape(-1).view(torch.uint8).numpy()) for pair in kv for t in pair)
    opts = {**options(names, "send", hostfile), "nixl_pool_bytes": 3 * layout.total_nbytes + (64 << 20),
            "mlx_pool_bytes": layout.total_nbytes + (1 << 20)}
    senders = {n: make_sender(n, TransportConfig(timeout_s=120, options=opts, token=load_token())) for n in names}
    payloads = {n: produced(s, layout, kv) for n, s in senders.items()}
    raw = {}
    say({"ready": True})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["name"] == "reference":
            raw.setdefault(msg["dest"], RawSender(msg["dest"]))
            say({"wall": raw[msg["dest"]].send(flat) * 1e3})
            continue
        start = time.perf_counter()
        senders[msg["name"]].send(msg["dest"], msg["tid"], layout, payloads[msg["name"]])
        say({"start": start})


def produced(sender, layout, kv):
    source = sender.alloc(layout)
    return kv if source is None else source.fill(kv)


if __name__ == "__main__":
    _out = _private_stdout()
    role = sys.argv[1]
    if role == "recv":
        recv(sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5])
    else:
        send(sys.argv[2].split(","), json.loads(sys.argv[3]), sys.argv[4])
