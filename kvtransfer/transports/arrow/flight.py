"""Arrow Flight transport, sending side (the protocol: ``wire``)."""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pyarrow as pa
import pyarrow.flight as fl

from .receiver import ArrowReceiver
from .wire import (AUTH_HEADER, GRPC_OPTIONS, MAX_STREAMS, VERSION, aligning_metadata, auth_value, column,
                         schema_for)
from ...base import KVSender, TransferError, TransportConfig
from ...layout import KVLayout
from ...phases import PhaseTimes
from ...pieces import PiecewiseKV
from ...sockets import parse_address, timed_layers
from ...tensors import as_bytes, check_layer, host_layers, to_host

__all__ = ["ArrowSender", "ArrowReceiver"]


class ArrowSender(KVSender):
    name = "arrow"
    sends_pieces = True
    streams_layers = True

    def __init__(self, cfg=None):
        self.cfg = cfg or TransportConfig()
        self.streams = int(self.cfg.options.get("arrow_streams", 1))
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"arrow_streams must be 1..{MAX_STREAMS}")
        self._idle: dict[str, list[fl.FlightClient]] = {}
        self._made = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(4 * self.streams, "arrow-send") if self.streams > 1 else None

    @contextlib.contextmanager
    def _client(self, dest: str):
        """An idle client of ``dest``, or a new one: each stream in flight has a connection of its own (gRPC would
        multiplex concurrent calls over one, which one receive thread and one flow-control window then share). A
        client that saw a failure is closed rather than reused."""
        with self._lock:
            idle = self._idle.setdefault(dest, [])
            client = idle.pop() if idle else None
        client = client or self._connect(dest, next(self._made))
        try:
            yield client
        except BaseException:
            client.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle[dest].append(client)
                return
        client.close()

    def _connect(self, dest: str, n: int) -> fl.FlightClient:
        """A client on a connection of its own: distinct channel options keep gRPC from sharing one."""
        host, port = parse_address(dest)
        options = GRPC_OPTIONS + [("pdserve.conn", n)]
        root = self.cfg.options.get("arrow_tls_root")
        if root:
            with open(root, "rb") as f:
                return fl.FlightClient(f"grpc+tls://{host}:{port}", tls_root_certs=f.read(), generic_options=options)
        return fl.FlightClient(f"grpc+tcp://{host}:{port}", generic_options=options)

    def send(self, dest, transfer_id, layout: KVLayout, layers, meta=None) -> PhaseTimes:
        phases, waited, began = PhaseTimes(bytes=layout.total_nbytes), [0.0], time.perf_counter()
        parts = self._parts(layout, layers)
        try:
            with phases.measure("wire"):
                if parts == 1:
                    batches = self._batches(layout, layers, phases, waited)
                    self._put(dest, transfer_id, layout, meta, 0, 1, batches, began)
                else:
                    batches = list(self._batches(layout, layers, phases, waited))
                    split = [[b for b in batches if b[2] % parts == j] for j in range(parts)]
                    futures = [self._pool.submit(self._put, dest, transfer_id, layout, meta, j, parts, split[j], began)
                               for j in range(1, parts)]
                    try:
                        self._put(dest, transfer_id, layout, meta, 0, parts, split[0], began)
                    finally:
                        errors = [f.exception() for f in futures]
                    if any(errors):
                        raise next(e for e in errors if e)
        except (fl.FlightError, pa.ArrowException, OSError, ValueError) as e:
            raise TransferError(f"transfer {transfer_id} to {dest} failed: {e}") from e
        phases.wire -= phases.d2h + phases.serialize + waited[0] * 1e3
        return phases

    def _parts(self, layout: KVLayout, layers) -> int:
        """Parallel streams for a KV that exists in full; one for a KV still being computed."""
        whole = isinstance(layers, (list, tuple)) or (isinstance(layers, PiecewiseKV) and layers.gate is None)
        return min(self.streams, layout.num_layers) if whole else 1

    def _put(self, dest, tid, layout, meta, part, parts, batches, began: float) -> None:
        header = msgpack.packb({"v": VERSION, "tid": tid, "meta": meta or {}, "part": part, "parts": parts})
        headers = [(AUTH_HEADER.encode(), auth_value(self.cfg.token).encode())] if self.cfg.token else []
        options = fl.FlightCallOptions(timeout=self.cfg.timeout_s, headers=headers)
        def since() -> float:
            return (time.perf_counter() - began) * 1e3

        with self._client(dest) as client:
            writer, reader = client.do_put(fl.FlightDescriptor.for_command(header), schema_for(layout), options=options)
            try:
                for batch, info, _ in batches:
                    info["e"] = since()
                    writer.write_with_metadata(batch, pa.py_buffer(aligning_metadata(info, batch.num_rows)))
                writer.write_metadata(pa.py_buffer(msgpack.packb({"e": since()})))
                writer.done_writing()
                ack = reader.read()
            except BaseException:  # the stream ends short: the receiver fails the transfer; the cause goes up
                with contextlib.suppress(fl.FlightError, pa.ArrowException, OSError):
                    writer.close()
                raise
            writer.close()
        if ack is None or ack.to_pybytes() != b"ok":
            raise TransferError(f"transfer {tid} to {dest}: no acknowledgement")

    def _batches(self, layout, layers, phases, waited):
        """``(record batch, metadata dict, layer)`` in order. A KV that exists in full is wrapped before the first
        byte goes out; one still being computed (a gated ``PiecewiseKV``, a generator) layer by layer as each is
        ready."""
        schema = schema_for(layout)

        def wrap(index, at, k, v):
            batch = pa.RecordBatch.from_arrays([column(k), column(v)], schema=schema)
            info = {"layer": index, "at": at, "t": [phases.d2h, phases.serialize, waited[0] * 1e3]}
            return batch, info, index

        if isinstance(layers, PiecewiseKV):
            with phases.measure("serialize"):
                layers.check()
            if layers.gate is None:
                with phases.measure("serialize"):
                    out = [wrap(*run) for i in range(layout.num_layers) for run in self._runs_of(layers, i)]
                yield from out
                return
            for i in range(layout.num_layers):
                waited[0] += layers.ready(i)
                with phases.measure("serialize"):
                    out = [wrap(*run) for run in self._runs_of(layers, i)]
                yield from out
            return
        if isinstance(layers, (list, tuple)):
            host = host_layers(layout, layers, phases)
            with phases.measure("serialize"):
                out = [wrap(i, 0, as_bytes(k), as_bytes(v)) for i, (k, v) in enumerate(host)]
            yield from out
            return
        for i, (k, v), wait in timed_layers(layers, layout.num_layers):
            waited[0] = wait[0]
            with phases.measure("d2h"):
                k, v = to_host(k), to_host(v)
            with phases.measure("serialize"):
                check_layer(layout, k, v)
                out = wrap(i, 0, as_bytes(k), as_bytes(v))
            yield out

    @staticmethod
    def _runs_of(kv: PiecewiseKV, layer: int):
        """``(layer, byte offset, k bytes, v bytes)`` for each piece of one layer."""
        at = 0
        for k, v in zip(*kv.layers[layer]):
            yield layer, at, as_bytes(k), as_bytes(v)
            at += k.numel() * k.element_size()

    def close(self):
        with self._lock:
            self._closed = True
            idle = [c for clients in self._idle.values() for c in clients]
            self._idle.clear()
        for client in idle:
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
