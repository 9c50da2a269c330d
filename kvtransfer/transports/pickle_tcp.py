"""The naive baseline pdserve was built to beat: ``torch.save`` the whole KV
(pickle) and push the blob over a TCP socket; the receiver ``torch.load``s it
(``weights_only``, so no code runs). Kept for A/B runs, never the default."""
from __future__ import annotations

import io

import torch

from .. import frames
from ..base import ReceivedKV
from ..sockets import SocketReceiver, SocketSender, timed_layers
from ..tensors import check_layer, to_host

PICKLE_OVERHEAD = 1 << 20


class PickleSender(SocketSender):
    name = "pickle"

    def _prepare(self, layout, layers, phases):
        host = []
        for _, (k, v), _ in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                host.append((to_host(k), to_host(v)))
        with phases.measure("serialize"):
            for k, v in host:
                check_layer(layout, k, v)
            blob = io.BytesIO()
            torch.save(host, blob)
        return blob.getbuffer()

    def _send_body(self, sock, layout, data, phases) -> float:
        with phases.measure("wire"):
            sock.sendall(frames.prefix(frames.LAYER, 0, len(data)))
            sock.sendall(data)
        return 0.0


class PickleReceiver(SocketReceiver):
    name = "pickle"

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        index, nbytes = frames.read_prefix(sock, frames.LAYER)
        limit = layout.total_nbytes + PICKLE_OVERHEAD + 512 * layout.num_layers
        if index != 0 or nbytes > limit:
            raise frames.FrameError(f"pickle blob of {nbytes} bytes, limit {limit} for the declared layout")
        blob = bytearray(nbytes)
        frames.recv_into(sock, memoryview(blob))
        phases = self._finish(sock, layout, start)
        with phases.measure("deserialize"):
            try:
                layers = torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as e:
                raise frames.FrameError(f"undecodable pickle payload: {e}") from None
            if not isinstance(layers, list) or len(layers) != layout.num_layers:
                raise frames.FrameError("pickle payload does not match the declared layout")
            for pair in layers:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise frames.FrameError("pickle payload does not match the declared layout")
                check_layer(layout, *pair)
        return ReceivedKV(tid, layout, None, phases, lambda: None, meta, layers=[tuple(p) for p in layers])
