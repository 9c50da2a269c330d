"""Arrow Flight transport: the decode side runs a Flight server, prefill
``do_put``s the KV.

The descriptor's command is a msgpack header ``{v, tid, layout, meta}``
(wire version 1). The stream's schema has two uint8 columns, ``k`` and
``v``; each record batch carries one run of one layer's K bytes and the V
bytes at the same place (a whole layer, or one piece of a paged pool), as
Arrow arrays over the tensors' memory (no copy on the sender). Each batch's
application metadata is msgpack ``{layer, at, t}``: the layer, the byte
offset of the run in that layer's K (and V) tensor, and the sender's
cumulative d2h/serialize milliseconds. Runs must arrive in order and cover
every layer exactly once. The receiver copies each run once, into its pooled
buffer or straight into the decode pool's blocks its ``land`` hook names
(``deserialize`` in the phases), then answers one metadata message ``ok``.

Auth: with a cluster token every call carries ``x-pdserve-auth:
<time>:<nonce>:<HMAC-SHA256(token, time:nonce)>``; a server middleware
refuses a missing or wrong MAC, one older than 60 s and a reused nonce (the
token itself never travels). TLS: ``arrow_tls_cert``/``arrow_tls_key`` on the
receiver, ``arrow_tls_root`` (the CA to trust) on the sender."""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from control.auth import require_token_for

from .base import KVSender, ReceivedKV, TransferError, TransferStatus, TransportConfig
from .layout import KVLayout, LayoutError
from .phases import PhaseTimes
from .pieces import PiecewiseKV
from .pool import BufferPool
from .sockets import TableReceiver, parse_address, timed_layers
from .tensors import as_bytes, check_layer, to_host

log = logging.getLogger(__name__)
VERSION = 1
AUTH_HEADER = "x-pdserve-auth"
AUTH_WINDOW_S = 60.0
GRPC_OPTIONS = [("grpc.http2.lookahead_bytes", 64 << 20), ("grpc.http2.bdp_probe", 1)]
SCHEMA = pa.schema([("k", pa.uint8()), ("v", pa.uint8())])


def _column(view) -> pa.Array:
    buf = pa.py_buffer(view)
    return pa.Array.from_buffers(pa.uint8(), len(buf), [None, buf])


def auth_value(token: bytes) -> str:
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(12)
    mac = hmac.new(token, f"{stamp}:{nonce}".encode(), hashlib.sha256).hexdigest()
    return f"{stamp}:{nonce}:{mac}"


class _AuthFactory(fl.ServerMiddlewareFactory):
    def __init__(self, token: bytes):
        self.token = token
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def start_call(self, info, headers):
        value = (headers.get(AUTH_HEADER) or [""])[0]
        parts = value.split(":")
        if len(parts) == 3:
            stamp, nonce, mac = parts
            want = hmac.new(self.token, f"{stamp}:{nonce}".encode(), hashlib.sha256).hexdigest()
            try:
                fresh = abs(time.time() - float(stamp)) < AUTH_WINDOW_S
            except ValueError:
                fresh = False
            if fresh and hmac.compare_digest(mac, want):
                with self.lock:
                    now = time.time()
                    self.seen = {n: t for n, t in self.seen.items() if now - t < 2 * AUTH_WINDOW_S}
                    if nonce not in self.seen:
                        self.seen[nonce] = now
                        return None
        raise fl.FlightUnauthenticatedError("pdserve cluster token required")


class _Server(fl.FlightServerBase):
    def __init__(self, owner: "ArrowReceiver", location, **kwargs):
        super().__init__(location, **kwargs)
        self.owner = owner

    def do_put(self, context, descriptor, reader, writer):
        self.owner.receive(descriptor.command, reader, writer)


class ArrowSender(KVSender):
    name = "arrow"
    sends_pieces = True

    def __init__(self, cfg=None):
        self.cfg = cfg or TransportConfig()
        self._clients: dict[str, fl.FlightClient] = {}
        self._lock = threading.Lock()

    def _client(self, dest: str) -> fl.FlightClient:
        with self._lock:
            if dest not in self._clients:
                host, port = parse_address(dest)
                root = self.cfg.options.get("arrow_tls_root")
                if root:
                    with open(root, "rb") as f:
                        self._clients[dest] = fl.FlightClient(f"grpc+tls://{host}:{port}", tls_root_certs=f.read())
                else:
                    self._clients[dest] = fl.FlightClient(f"grpc+tcp://{host}:{port}", generic_options=GRPC_OPTIONS)
            return self._clients[dest]

    def send(self, dest, transfer_id, layout: KVLayout, layers, meta=None) -> PhaseTimes:
        phases = PhaseTimes(bytes=layout.total_nbytes)
        header = msgpack.packb({"v": VERSION, "tid": transfer_id, "layout": layout.to_dict(), "meta": meta or {}})
        headers = [(AUTH_HEADER.encode(), auth_value(self.cfg.token).encode())] if self.cfg.token else []
        options = fl.FlightCallOptions(timeout=self.cfg.timeout_s, headers=headers)
        try:
            writer, reader = self._client(dest).do_put(fl.FlightDescriptor.for_command(header), SCHEMA, options=options)
            try:
                with phases.measure("wire"):
                    for index, at, k, v in self._runs(layout, layers, phases):
                        batch = pa.RecordBatch.from_arrays([_column(k), _column(v)], schema=SCHEMA)
                        info = {"layer": index, "at": at, "t": [phases.d2h, phases.serialize]}
                        writer.write_with_metadata(batch, pa.py_buffer(msgpack.packb(info)))
                    writer.done_writing()
                    ack = reader.read()
            finally:
                writer.close()
        except (fl.FlightError, pa.ArrowException, OSError, ValueError) as e:
            raise TransferError(f"transfer {transfer_id} to {dest} failed: {e}") from e
        if ack is None or ack.to_pybytes() != b"ok":
            raise TransferError(f"transfer {transfer_id} to {dest}: no acknowledgement")
        phases.wire -= phases.d2h + phases.serialize
        return phases

    @staticmethod
    def _runs(layout, layers, phases):
        """``(layer, byte offset, k bytes, v bytes)`` in order (the generator holds the tensors while they are sent)."""
        if isinstance(layers, PiecewiseKV):
            with phases.measure("serialize"):
                layers.check()
            for i, (ks, vs) in enumerate(layers.layers):
                at = 0
                for k, v in zip(ks, vs):
                    yield i, at, as_bytes(k), as_bytes(v)
                    at += k.numel() * k.element_size()
            return
        for i, (k, v), _ in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = to_host(k), to_host(v)
            with phases.measure("serialize"):
                check_layer(layout, k, v)
            yield i, 0, as_bytes(k), as_bytes(v)

    def close(self):
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


class ArrowReceiver(TableReceiver):
    name = "arrow"
    lands_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.pool = BufferPool(self.cfg.pool_bytes)
        self._server: _Server | None = None
        self.refused = 0

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self._server.port}"

    def start(self) -> None:
        require_token_for(self.cfg.host, self.cfg.token, "arrow KV receiver")
        opts = self.cfg.options
        kwargs = {"middleware": {"auth": _AuthFactory(self.cfg.token)}} if self.cfg.token else {}
        scheme = "grpc+tcp"
        if opts.get("arrow_tls_cert"):
            with open(opts["arrow_tls_cert"], "rb") as c, open(opts["arrow_tls_key"], "rb") as k:
                kwargs["tls_certificates"] = [(c.read(), k.read())]
            scheme = "grpc+tls"
        self._server = _Server(self, f"{scheme}://{self.cfg.host}:{self.cfg.port}", **kwargs)

    def receive(self, command: bytes, reader, writer) -> None:
        start = time.perf_counter()
        try:
            header = msgpack.unpackb(command)
            layout = KVLayout.from_dict(header.get("layout"))
            tid = header.get("tid")
            if header.get("v") != VERSION or not isinstance(tid, str) or not tid or len(tid) > 256:
                raise ValueError("bad header (version or transfer id)")
        except (ValueError, TypeError, LayoutError, msgpack.UnpackException) as e:
            self.refused += 1
            raise fl.FlightServerError(f"refused: {e}") from None
        if layout.total_nbytes > self.cfg.max_transfer_bytes:
            self.refused += 1
            raise fl.FlightServerError(f"refused: declared {layout.total_nbytes} bytes over limit "
                                       f"{self.cfg.max_transfer_bytes}")
        if not self.table.begin(tid):
            self.refused += 1
            raise fl.FlightServerError(f"refused: transfer {tid} is not expected (duplicate or aborted)")
        try:
            result = self._receive_layers(tid, layout, header.get("meta") or {}, reader, start)
        except Exception as e:
            self.table.fail(tid, f"transfer failed: {e}")
            raise fl.FlightServerError(f"transfer {tid} failed: {e}") from None
        self.table.done(tid, result)
        writer.write(pa.py_buffer(b"ok"))

    def _receive_layers(self, tid, layout, meta, reader, start) -> ReceivedKV:
        landing = self.land(tid, layout) if self.land else None
        buf = None if landing is not None else self.pool.acquire(layout.total_nbytes)
        release = landing.release if landing is not None else (lambda: self.pool.release(buf))
        phases, n = PhaseTimes(bytes=layout.total_nbytes), layout.tensor_nbytes
        try:
            if landing is not None:
                landing.kv.check()
                dest = [self._flat(landing.kv, i) for i in range(layout.num_layers)]
            else:
                flat = buf[:layout.total_nbytes].numpy()
                dest = [(flat[layout.layer_offset(i):layout.layer_offset(i) + n],
                         flat[layout.layer_offset(i) + n:layout.layer_offset(i) + 2 * n]) for i in range(layout.num_layers)]
            layer, at, sender = 0, 0, [0.0, 0.0]
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                info = msgpack.unpackb(chunk.app_metadata.to_pybytes()) if chunk.app_metadata else {}
                batch = chunk.data
                if batch is None or batch.num_columns != 2 or info.get("layer") != layer or info.get("at") != at:
                    raise ValueError(f"run out of order: expected layer {layer} at {at}")
                size = batch.num_rows
                if at + size > n:
                    raise ValueError(f"run of {size} bytes past the end of layer {layer}")
                with phases.measure("deserialize"):
                    for column, target in zip(batch.columns, dest[layer]):
                        data = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=size, offset=column.offset)
                        self._write(target, at, data)
                sender = info.get("t") or sender
                at += size
                if at == n:
                    layer, at = layer + 1, 0
                if self.table.status(tid) == TransferStatus.ABORTED:
                    raise ConnectionError("aborted by receiver")
            if layer != layout.num_layers:
                raise ValueError(f"stream ended after {layer} of {layout.num_layers} layers")
        except BaseException:
            release()
            raise
        elapsed = (time.perf_counter() - start) * 1e3
        phases.d2h, phases.serialize = float(sender[0]), float(sender[1])
        phases.wire = max(0.0, elapsed - phases.deserialize - phases.d2h - phases.serialize)
        if landing is not None:
            return ReceivedKV(tid, layout, None, phases, release, meta, landed=landing.kv)
        return ReceivedKV(tid, layout, buf[:layout.total_nbytes], phases, release, meta)

    @staticmethod
    def _flat(kv: PiecewiseKV, layer: int) -> tuple:
        """Layer ``layer``'s K and V destination as lists of ``(byte offset, uint8 array)`` pieces."""
        out = []
        for pieces in kv.layers[layer]:
            at, runs = 0, []
            for p in pieces:
                view = np.frombuffer(as_bytes(p), dtype=np.uint8)
                runs.append((at, view))
                at += view.size
            out.append(runs)
        return tuple(out)

    @staticmethod
    def _write(target, at: int, data) -> None:
        if isinstance(target, np.ndarray):
            target[at:at + data.size] = data
            return
        end = at + data.size
        for start, view in target:
            lo, hi = max(at, start), min(end, start + view.size)
            if lo < hi:
                view[lo - start:hi - start] = data[lo - at:hi - at]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

