"""NCCL transport: ``torch.distributed`` point-to-point from the prefill GPU to
the decode GPU (NVLink or GPUDirect RDMA), no host copies at all.

Like ``mlx``, NCCL ranks form a fixed world (``nccl_init`` = a
``tcp://host:port`` rendezvous, ``nccl_rank``, world size 2), so metadata
travels over the socket framing of ``sockets``: BEGIN, GRANT (the receiver
posts one ``recv`` into a pooled buffer on its GPU, one transfer at a time),
the sender ``send``s the KV in one operation, END, ACK. A KV the prefill
engine wrote into ``alloc``'s region of the sender's GPU slab
(``nccl_pool_bytes``, allocated on first use) goes straight from there; other
layers are first gathered into a pooled staging buffer in the canonical
layout (device copy, reported as serialize; ``staged_bytes``). The receiver's
record ends when its ``recv`` has completed: the bytes are in place then.
Options: ``nccl_init``, ``nccl_rank``, ``device`` (default ``cuda:<rank>``)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import frames
from .arena import Arena
from .base import ReceivedKV, TransferError
from .pool import BufferPool
from .sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from .tensors import check_layer

_lock = threading.Lock()
DEFAULT_POOL_BYTES = 1 << 30


def init(cfg) -> torch.device:
    opts = cfg.options
    rank = int(opts.get("nccl_rank", 0))
    device = torch.device(opts.get("device", f"cuda:{rank}"))
    with _lock:
        if not dist.is_initialized():
            if "nccl_init" not in opts:
                raise TransferError("nccl transport needs options nccl_init (tcp://host:port) and nccl_rank")
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=opts["nccl_init"], rank=rank, world_size=2,
                                    timeout=timedelta(seconds=cfg.timeout_s * 4), device_id=device)
    return device


def _attach(endpoint) -> None:
    """The GPU side of either end: joined world, device, buffer pool, one transfer at a time."""
    endpoint.device = init(endpoint.cfg)
    endpoint.pool = BufferPool(endpoint.cfg.pool_bytes, device=endpoint.device)
    endpoint._data_lock = threading.Lock()


class NcclSender(SocketSender):
    name = "nccl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)

    def alloc(self, layout, device="cpu"):
        if torch.device(device) != self.device:
            return None
        with _lock:
            if self.owned is None:
                nbytes = int(self.cfg.options.get("nccl_pool_bytes", DEFAULT_POOL_BYTES))
                self.owned = Arena(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return self.owned.source(layout)

    def _send_body(self, sock, layout, layers, phases) -> float:
        grant = read_grant(sock, {"rank": int})
        dst, waited = grant["rank"], [0.0]
        torch.cuda.set_device(self.device)
        if isinstance(layers, slice):
            with self._data_lock, phases.measure("wire"):
                dist.send(self.owned.memory[layers], dst)
                torch.cuda.synchronize(self.device)
            return phases.serialize / 1e3
        parts = []
        for _, (k, v), waited in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = (t.to(self.device) for t in (k, v))
            with phases.measure("serialize"):
                check_layer(layout, k, v)
                parts += [t.contiguous().view(-1).view(torch.uint8) for t in (k, v)]
        staging = self.pool.acquire(layout.total_nbytes)
        try:
            with self._data_lock:
                with phases.measure("serialize"):
                    torch.cat(parts, out=staging[:layout.total_nbytes])
                    torch.cuda.synchronize(self.device)
                    self.staged_bytes += layout.total_nbytes
                with phases.measure("wire"):
                    dist.send(staging[:layout.total_nbytes], dst)
                    torch.cuda.synchronize(self.device)
        finally:
            self.pool.release(staging)
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]


class NcclReceiver(SocketReceiver):
    name = "nccl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)

    def _receive_body(self, sock, tid, layout, meta, start) -> ReceivedKV:
        src = 1 - dist.get_rank()
        torch.cuda.set_device(self.device)
        buf = self.pool.acquire(layout.total_nbytes)
        try:
            with self._data_lock:
                sock.sendall(frames.meta_frame(frames.GRANT, {"rank": dist.get_rank()}))
                dist.recv(buf[:layout.total_nbytes], src)
                torch.cuda.synchronize(self.device)
            phases = self._finish(sock, layout, start, landed=time.perf_counter())
        except BaseException:
            self.pool.release(buf)
            raise
        return ReceivedKV(tid, layout, buf[:layout.total_nbytes], phases, lambda: self.pool.release(buf), meta)
