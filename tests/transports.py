"""Which transports this machine can run, and the harness for the conformance suite."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
from multiprocessing.connection import Client

import pytest

from control.listen import port_of, reserve
from kvtransfer import TransferError

CPU_TRANSPORTS = ["tcp", "shm", "pickle"]
OPTIONAL = {"ray": "ray", "mlx": "mlx", "nixl": "nixl", "arrow": "pyarrow"}


def available() -> list:
    params = [pytest.param(n, id=n) for n in CPU_TRANSPORTS]
    for name, module in OPTIONAL.items():
        missing = importlib.util.find_spec(module) is None
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(missing, reason=f"{module} not installed")))
    params.append(pytest.param("nccl", id="nccl", marks=pytest.mark.skip(
        reason="nccl needs a fixed rank pair: tests/test_nccl.py runs its checks (bench.nccl_check) and pdserve up over gloo, and on two GPUs when present")))
    return params


class MlxWorld:
    """This test process is rank 1 (receiver); a child process is rank 0 (sender)."""

    def __init__(self, tmp_dir: str):
        hostfile = os.path.join(tmp_dir, "mlx-hosts.json")
        self.reserved = [reserve() for _ in range(2)]  # held until the ring binds them (control.listen)
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{port_of(sock)}"] for sock in self.reserved], f)
        self.options = {"mlx_hostfile": hostfile, "mlx_rank": 1, "mlx_backend": "ring"}
        self.key = secrets.token_bytes(16)
        env = {**os.environ, "MLX_HOSTFILE": hostfile, "MLX_RANK": "0", "PDSERVE_TEST_KEY": self.key.hex()}
        self.child = subprocess.Popen([sys.executable, "-m", "tests.mlx_peer"], env=env, stdout=subprocess.PIPE, text=True)
        self.port = int(self.child.stdout.readline())

    def close(self):
        self.child.kill()
        self.child.wait()
        for sock in self.reserved:
            sock.close()


class ProxySender:
    """Stands in for the sender of the rank-0 child process (one connection per send)."""

    name = "mlx"

    def __init__(self, world: MlxWorld):
        self.world = world

    def send(self, dest, tid, layout, layers, meta=None, die_after=-1, placed=False):
        import torch

        from kvtransfer.tensors import is_mlx, to_host

        layers = list(layers)
        as_mlx = bool(layers) and is_mlx(layers[0][0])
        blobs = [tuple(to_host(t).contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in pair)
                 for pair in layers]
        with Client(("127.0.0.1", self.world.port), authkey=self.world.key) as conn:
            conn.send((dest, tid, layout.to_dict(), blobs, die_after, placed, as_mlx))
            if die_after >= 0:
                return
            reply = conn.recv()
        if isinstance(reply, str):
            raise TransferError(reply)
        return reply

    def close(self):
        pass


def send_placed(sender, dest, tid, kv, whole=False) -> tuple[bool, int]:
    """Produce ``kv`` in the sender's own memory (as prefill does) and send it from there;
    returns (whether the sender offered memory, bytes it staged). Plain send when it offers none.
    ``whole``: pass the ``SourceKV`` itself rather than its layers."""
    from kvtransfer.tensors import layout_of

    if isinstance(sender, ProxySender):
        return tuple(sender.send(dest, tid, layout_of(kv), kv, placed=True))
    layout, before = layout_of(kv), sender.staged_bytes
    source = sender.alloc(layout)
    if source is None:
        sender.send(dest, tid, layout, kv)
        return False, sender.staged_bytes - before
    try:
        source.fill(kv)
        sender.send(dest, tid, layout, source if whole else source.layers)
    finally:
        source.release()
    return True, sender.staged_bytes - before
