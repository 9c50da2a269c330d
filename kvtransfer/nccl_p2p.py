"""NCCL transport: ``torch.distributed`` point-to-point from the prefill GPU to
the decode GPU (NVLink or GPUDirect RDMA), no host copies at all.

Like ``mlx``, NCCL ranks form a fixed world (``nccl_init`` = a
``tcp://host:port`` rendezvous, ``nccl_rank``, world size 2), so metadata
travels over the socket framing of ``sockets``: BEGIN, GRANT (the receiver
posts one ``recv`` into a pooled buffer on its GPU, one transfer at a time),
the sender gathers the layers into a pooled staging buffer on its GPU in the
canonical layout (device copy, reported as serialize) and ``send``s it in one
operation, END, ACK. Options:
``nccl_init``, ``nccl_rank``, ``device`` (default ``cuda:<rank>``)."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from . import frames
from .base import ReceivedKV, TransferError
from .pool import BufferPool
from .sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from .tensors import check_layer

_lock = threading.Lock()


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


class NcclSender(SocketSender):
    name = "nccl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.device = init(self.cfg)
        self.pool = BufferPool(self.cfg.pool_bytes, device=self.device)
        self._data_lock = threading.Lock()

    def _send_body(self, sock, layout, layers, phases) -> float:
        grant = read_grant(sock, {"rank": int})
        dst, waited = grant["rank"], [0.0]
        torch.cuda.set_device(self.device)
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
        self.device = init(self.cfg)
        self.pool = BufferPool(self.cfg.pool_bytes, device=self.device)
        self._data_lock = threading.Lock()

    def _receive_body(self, sock, tid, layout, meta, start) -> ReceivedKV:
        src = 1 - dist.get_rank()
        torch.cuda.set_device(self.device)
        buf = self.pool.acquire(layout.total_nbytes)
        try:
            with self._data_lock:
                sock.sendall(frames.meta_frame(frames.GRANT, {"rank": dist.get_rank()}))
                dist.recv(buf[:layout.total_nbytes], src)
                torch.cuda.synchronize(self.device)
            phases = self._finish(sock, layout, start)
        except BaseException:
            self.pool.release(buf)
            raise
        return ReceivedKV(tid, layout, buf[:layout.total_nbytes], phases, lambda: self.pool.release(buf), meta)
