"""Same-host shared-memory transport.

The receiver maps one shared-memory segment at startup and carves a region
per transfer out of it (``Arena``). Over its socket it answers BEGIN with a
GRANT ``{path, offset}``; the sender maps the segment once (cached) and copies
each layer straight into the region, then sends END. The decode side reads
the region in place: no serialization, one copy in total."""
from __future__ import annotations

import mmap
import os
import tempfile
import threading

import torch

from . import frames
from .arena import Arena
from .base import ReceivedKV
from .pieces import PiecewiseKV
from .sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from .tensors import check_layer, host_layers, to_host

DEFAULT_SEGMENT_BYTES = 1 << 30


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _map(path: str, size: int | None = None):
    fd = os.open(path, os.O_RDWR)
    try:
        size = size or os.fstat(fd).st_size
        region = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return region, torch.frombuffer(region, dtype=torch.uint8)


def _copy_layer(segment: torch.Tensor, base: int, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
    segment[base:base + n].copy_(k.reshape(-1).view(torch.uint8))
    segment[base + n:base + 2 * n].copy_(v.reshape(-1).view(torch.uint8))


class ShmSender(SocketSender):
    name = "shm"
    sends_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self._maps: dict[str, tuple] = {}
        self._maps_lock = threading.Lock()

    def _segment(self, path: str) -> torch.Tensor:
        with self._maps_lock:
            if path not in self._maps:
                if not os.path.exists(path):
                    raise ValueError(f"shared-memory segment {path} not found: shm needs prefill and decode on one host")
                self._maps[path] = _map(path)
            return self._maps[path][1]

    def _send_body(self, sock, layout, layers, phases) -> float:
        grant = read_grant(sock, {"path": str, "offset": int})
        path, offset = grant["path"], grant["offset"]
        segment = self._segment(path)
        if offset < 0 or offset + layout.total_nbytes > segment.numel():
            raise frames.FrameError("GRANT outside the segment")
        waited, n = [0.0], layout.tensor_nbytes
        if isinstance(layers, PiecewiseKV):
            with phases.measure("serialize"):
                layers.check()
            with phases.measure("wire"):
                for i, (k_pieces, v_pieces) in enumerate(layers.layers):
                    at = offset + layout.layer_offset(i)
                    for piece in (*k_pieces, *v_pieces):
                        raw = piece.reshape(-1).view(torch.uint8)
                        segment[at:at + raw.numel()].copy_(raw)
                        at += raw.numel()
            return phases.serialize / 1e3
        if isinstance(layers, (list, tuple)):
            host = host_layers(layout, layers, phases)
            with phases.measure("wire"):
                for i, (k, v) in enumerate(host):
                    _copy_layer(segment, offset + layout.layer_offset(i), n, k, v)
            return (phases.d2h + phases.serialize) / 1e3
        for i, (k, v), waited in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = to_host(k), to_host(v)
            with phases.measure("serialize"):
                check_layer(layout, k, v)
            with phases.measure("wire"):
                _copy_layer(segment, offset + layout.layer_offset(i), n, k, v)
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]

    def close(self):
        super().close()
        with self._maps_lock:
            self._maps.clear()


class ShmReceiver(SocketReceiver):
    name = "shm"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        size = int(self.cfg.options.get("shm_bytes", min(DEFAULT_SEGMENT_BYTES, self.cfg.pool_bytes)))
        fd, self.path = tempfile.mkstemp(prefix="pdserve-kv-", dir=_segment_dir())
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._region, memory = _map(self.path, size)
        self.arena = Arena(memory)

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        offset, view = self.arena.acquire(layout.total_nbytes)
        try:
            sock.sendall(frames.meta_frame(frames.GRANT, {"path": self.path, "offset": offset}))
            phases = self._finish(sock, layout, start)
        except BaseException:
            self.arena.release(offset)
            raise
        return ReceivedKV(tid, layout, view, phases, lambda: self.arena.release(offset), meta)

    def close(self):
        super().close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
