"""TCP transport: a msgpack header, then each layer's K and V bytes sent
straight from the source tensors and received with ``recv_into`` into a pooled
destination buffer. No pickle, no intermediate copy (framing in ``frames``)."""
from __future__ import annotations

import time

from .. import frames
from ..base import ReceivedKV, TransferStatus
from ..pieces import PiecewiseKV
from ..sockets import SocketReceiver, SocketSender, parse_address, timed_layers
from ..tensors import as_bytes, check_layer, host_layers, to_host

__all__ = ["TcpSender", "TcpReceiver", "parse_address"]

IOV_BATCH = 512


def send_parts(sock, parts: list) -> None:
    """``sendall`` of several buffers with as few ``sendmsg`` calls as possible."""
    parts = [memoryview(p).cast("B") for p in parts]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def send_batched(sock, parts: list) -> None:
    for start in range(0, len(parts), IOV_BATCH):
        send_parts(sock, parts[start:start + IOV_BATCH])


class TcpSender(SocketSender):
    name = "tcp"
    sends_pieces = True
    streams_layers = True

    def _send_body(self, sock, layout, layers, phases) -> float:
        if isinstance(layers, PiecewiseKV):
            return self._send_pieces(sock, layout, layers, phases)
        if isinstance(layers, (list, tuple)):
            return self._send_all(sock, layout, layers, phases)
        clock, waited = time.perf_counter, [0.0]
        d2h = serialize = wire = 0.0
        for i, (k, v), waited in timed_layers(layers, layout.num_layers):
            t0 = clock()
            k, v = to_host(k), to_host(v)
            t1 = clock()
            check_layer(layout, k, v)
            parts = [frames.prefix(frames.LAYER, i, layout.layer_nbytes), as_bytes(k), as_bytes(v)]
            t2 = clock()
            send_parts(sock, parts)
            d2h, serialize, wire = d2h + t1 - t0, serialize + t2 - t1, wire + clock() - t2
        phases.d2h, phases.serialize, phases.wire = d2h * 1e3, serialize * 1e3, wire * 1e3
        return d2h + serialize + waited[0]


    def _send_all(self, sock, layout, layers, phases) -> float:
        """KV that already exists in full: views of every layer first, then one stream of ``sendmsg`` calls."""
        host = host_layers(layout, layers, phases)
        with phases.measure("serialize"):
            parts = []
            for i, (k, v) in enumerate(host):
                parts += [frames.prefix(frames.LAYER, i, layout.layer_nbytes), as_bytes(k), as_bytes(v)]
        with phases.measure("wire"):
            send_batched(sock, parts)
        return (phases.d2h + phases.serialize) / 1e3


    def _send_pieces(self, sock, layout, kv: PiecewiseKV, phases) -> float:
        """KV in pieces (pool blocks): every piece is one iov of the ``sendmsg`` stream, nothing is copied.
        KV still being computed goes layer by layer, each as soon as the engine wrote it."""
        with phases.measure("serialize"):
            kv.check()
            layers = [[frames.prefix(frames.LAYER, i, layout.layer_nbytes), *kv.parts(i)] for i in range(layout.num_layers)]
        if kv.gate is not None:
            waited = 0.0
            for i, parts in enumerate(layers):
                waited += kv.ready(i)
                send_batched(sock, parts)
            return phases.serialize / 1e3 + waited
        with phases.measure("wire"):
            send_batched(sock, [p for layer in layers for p in layer])
        return phases.serialize / 1e3


class TcpReceiver(SocketReceiver):
    name = "tcp"
    lands_pieces = True

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        landing = self.land(tid, layout) if self.land else None
        if landing is not None:
            return self._receive_landed(sock, tid, layout, meta, start, landing)
        buf = self.pool.acquire(layout.total_nbytes)
        try:
            view = memoryview(buf.numpy()).cast("B")
            for i in range(layout.num_layers):
                index, nbytes = frames.read_prefix(sock, frames.LAYER)
                if index != i or nbytes != layout.layer_nbytes:
                    raise frames.FrameError(f"layer frame {index}/{nbytes}B, expected {i}/{layout.layer_nbytes}B")
                off = layout.layer_offset(i)
                frames.recv_into(sock, view[off:off + nbytes])
                if self.table.status(tid) == TransferStatus.ABORTED:
                    raise ConnectionError("aborted by receiver")
            phases = self._finish(sock, layout, start)
        except BaseException:
            self.pool.release(buf)
            raise
        return ReceivedKV(tid, layout, buf[:layout.total_nbytes], phases, lambda: self.pool.release(buf), meta)

    def _receive_landed(self, sock, tid, layout, meta, start, landing) -> ReceivedKV:
        """Each layer's bytes straight into the pieces the ``land`` hook named (the blocks that will hold them)."""
        try:
            landing.kv.check()
            for i in range(layout.num_layers):
                index, nbytes = frames.read_prefix(sock, frames.LAYER)
                if index != i or nbytes != layout.layer_nbytes:
                    raise frames.FrameError(f"layer frame {index}/{nbytes}B, expected {i}/{layout.layer_nbytes}B")
                for part in landing.kv.parts(i):
                    frames.recv_into(sock, part)
                if self.table.status(tid) == TransferStatus.ABORTED:
                    raise ConnectionError("aborted by receiver")
            phases = self._finish(sock, layout, start)
        except BaseException:
            landing.release()
            raise
        return ReceivedKV(tid, layout, None, phases, landing.release, meta, landed=landing.kv)
