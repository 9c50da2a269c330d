"""Same-host shared-memory transport.

The receiver maps one shared-memory segment at startup and carves a region
per transfer out of it (``Arena``). Over its socket it answers BEGIN with a
GRANT ``{path, offset}``; the sender maps the segment once (cached) and copies
each layer straight into the region, then sends END. The decode side reads
the region in place: no serialization, one copy in total.

When the decode worker keeps its KV pool in shared memory (``SharedMemory``,
handed to the receiver with ``share``) and its ``land`` hook names blocks of
it, the GRANT says where those blocks are instead: ``{path, bases, rel,
sizes}``, layer ``i``'s K pieces at ``bases[i][0] + rel[j]`` (``sizes[j]``
bytes each), V's at ``bases[i][1] + rel[j]``; the sender copies the layers
(or its own pool blocks) straight into the decode pool."""
from __future__ import annotations

import mmap
import os
import tempfile
import threading

import torch

from .. import frames
from ..arena import Arena
from ..base import ReceivedKV
from ..pieces import PiecewiseKV, block_map, block_runs
from ..sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from ..tensors import check_layer, host_layers, to_host

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


class SharedMemory:
    """A shared-memory file mapped here as a uint8 tensor (the decode worker's KV pool); unlinked by ``close``."""

    def __init__(self, nbytes: int):
        fd, self.path = tempfile.mkstemp(prefix="pdserve-pool-", dir=_segment_dir())
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._region, self.tensor = _map(self.path, nbytes)

    def offset_of(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.tensor.data_ptr()

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def block_grant(shared: SharedMemory, kv: PiecewiseKV) -> dict | None:
    """The compact GRANT naming ``kv``'s pieces in ``shared``, or None when they are not blocks at one set of
    offsets in every layer (then the transfer goes through the segment)."""
    grant = block_map(kv, shared.tensor)
    return None if grant is None else {"path": shared.path, **grant}


def _copy_runs(segment: torch.Tensor, runs: list, sources: list) -> None:
    """Copy the bytes of ``sources`` (uint8 tensors, in order) into ``runs`` of ``segment``."""
    it = iter(sources)
    src, pos = next(it), 0
    for off, n in runs:
        while n:
            if pos == src.numel():
                src, pos = next(it), 0
            take = min(n, src.numel() - pos)
            segment[off:off + take].copy_(src[pos:pos + take])
            off, n, pos = off + take, n - take, pos + take


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _stream(layout, layers, phases, write) -> float:
    """Layers as they come (while prefill may still compute): each to the host, checked, then ``write(i, k, v)``;
    returns the sender's own seconds (see ``SocketSender._send_body``)."""
    waited = [0.0]
    for i, (k, v), waited in timed_layers(layers, layout.num_layers):
        with phases.measure("d2h"):
            k, v = to_host(k), to_host(v)
        with phases.measure("serialize"):
            check_layer(layout, k, v)
        with phases.measure("wire"):
            write(i, k, v)
    return (phases.d2h + phases.serialize) / 1e3 + waited[0]


class ShmSender(SocketSender):
    name = "shm"
    sends_pieces = True
    streams_layers = True

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
        grant = read_grant(sock, {"path": str})
        if "bases" in grant:
            return self._send_blocks(grant, layout, layers, phases)
        if not isinstance(grant.get("offset"), int):
            raise frames.FrameError("GRANT without an offset")
        path, offset = grant["path"], grant["offset"]
        segment = self._segment(path)
        if offset < 0 or offset + layout.total_nbytes > segment.numel():
            raise frames.FrameError("GRANT outside the segment")
        n = layout.tensor_nbytes
        if isinstance(layers, PiecewiseKV):
            with phases.measure("serialize"):
                layers.check()
            waited = 0.0
            for i, (k_pieces, v_pieces) in enumerate(layers.layers):
                waited += layers.ready(i)
                at = offset + layout.layer_offset(i)
                for piece in (*k_pieces, *v_pieces):
                    raw = piece.reshape(-1).view(torch.uint8)
                    segment[at:at + raw.numel()].copy_(raw)
                    at += raw.numel()
            return phases.serialize / 1e3 + waited
        if isinstance(layers, (list, tuple)):
            host = host_layers(layout, layers, phases)
            with phases.measure("wire"):
                for i, (k, v) in enumerate(host):
                    _copy_layer(segment, offset + layout.layer_offset(i), n, k, v)
            return (phases.d2h + phases.serialize) / 1e3
        return _stream(layout, layers, phases,
                       lambda i, k, v: _copy_layer(segment, offset + layout.layer_offset(i), n, k, v))

    def _send_blocks(self, grant, layout, layers, phases) -> float:
        """Into the decode pool's blocks: every layer's K and V bytes across the granted runs."""
        segment = self._segment(grant["path"])
        runs = block_runs(grant, layout, segment.numel())
        if isinstance(layers, PiecewiseKV):
            with phases.measure("serialize"):
                layers.check()
            waited = 0.0
            for i, ((k_runs, v_runs), (ks, vs)) in enumerate(zip(runs, layers.layers)):
                waited += layers.ready(i)
                _copy_runs(segment, k_runs, [_bytes(p) for p in ks])
                _copy_runs(segment, v_runs, [_bytes(p) for p in vs])
            return phases.serialize / 1e3 + waited

        def write(i, k, v):
            _copy_runs(segment, runs[i][0], [_bytes(k)])
            _copy_runs(segment, runs[i][1], [_bytes(v)])
        return _stream(layout, layers, phases, write)

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
        self.shared: SharedMemory | None = None

    def share(self, shared: SharedMemory) -> None:
        """Land transfers in ``shared`` (where the decode pool lives) through the ``land`` hook."""
        self.shared = shared
        self.lands_pieces = True

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        landing = self.land(tid, layout) if self.land and self.shared else None
        grant = block_grant(self.shared, landing.kv.check()) if landing else None
        if landing is not None and grant is None:
            landing.release()
        elif landing is not None:
            try:
                sock.sendall(frames.meta_frame(frames.GRANT, grant))
                phases = self._finish(sock, layout, start)
            except BaseException:
                landing.release()
                raise
            return ReceivedKV(tid, layout, None, phases, landing.release, meta, landed=landing.kv)
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
