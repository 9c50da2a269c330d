"""Arrow Flight transport, receiving side: a Flight server whose ``do_put``
calls are the parts of transfers (the protocol: ``wire``). The first
part of a transfer to arrive claims its id and its landing; each part lands
its layers; the part that completes the set finishes the transfer, and every
part is answered once all have landed (or fails with the transfer)."""
from __future__ import annotations

import ctypes
import threading
import time

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import torch

from control.auth import require_token_for

from .wire import MAX_STREAMS, VERSION, AuthFactory, aligned, layout_dict
from ...base import ReceivedKV, TransferStatus
from ...heap import keep_freed_memory
from ...layout import KVLayout, LayoutError
from ...phases import PhaseTimes
from ...pieces import PiecewiseKV
from ...pool import BufferPool
from ...sockets import TableReceiver
from ...tensors import TORCH_DTYPES, as_bytes, unpack


class _Server(fl.FlightServerBase):
    def __init__(self, owner: "ArrowReceiver", location, **kwargs):
        super().__init__(location, **kwargs)
        self.owner = owner

    def do_put(self, context, descriptor, reader, writer):
        self.owner.receive(descriptor.command, reader, writer)


class _Incoming:
    """One transfer's state shared by its parts."""

    def __init__(self, tid, layout: KVLayout, meta: dict, parts: int, landing, pool: BufferPool, start: float):
        self.tid, self.layout, self.meta, self.parts, self.landing, self.pool = tid, layout, meta, parts, landing, pool
        self.began = start
        self.phases = PhaseTimes(bytes=layout.total_nbytes)
        self.kept: list = [None] * layout.num_layers
        self.buf = None
        self.sender = [0.0, 0.0, 0.0]
        self.seen: set[int] = set()
        self.finished = 0
        self.active = 0
        self.released = False
        self.error: str | None = None
        self.cond = threading.Condition()

    def target(self, layer: int):
        if self.landing is not None:
            return ArrowReceiver.flat(self.landing.kv, layer)
        with self.cond:
            if self.buf is None:
                self.buf = self.pool.acquire(self.layout.total_nbytes)
        flat, n, at = self.buf[:self.layout.total_nbytes].numpy(), self.layout.tensor_nbytes, self.layout.layer_offset(layer)
        return flat[at:at + n], flat[at + n:at + 2 * n]

    def release(self) -> None:
        self.kept = []
        if self.landing is not None:
            self.landing.release()
        elif self.buf is not None:
            self.pool.release(self.buf)
            self.buf = None


class ArrowReceiver(TableReceiver):
    name = "arrow"
    lands_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.pool = BufferPool(self.cfg.pool_bytes)
        self._server: _Server | None = None
        self._incoming: dict[str, _Incoming] = {}
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self._server.port}"

    def start(self) -> None:
        require_token_for(self.cfg.host, self.cfg.token, "arrow KV receiver")
        opts = self.cfg.options
        if self.cfg.flag("arrow_keep_heap", True):
            keep_freed_memory()
        kwargs = {"middleware": {"auth": AuthFactory(self.cfg.token)}} if self.cfg.token else {}
        scheme = "grpc+tcp"
        if opts.get("arrow_tls_cert"):
            with open(opts["arrow_tls_cert"], "rb") as c, open(opts["arrow_tls_key"], "rb") as k:
                kwargs["tls_certificates"] = [(c.read(), k.read())]
            scheme = "grpc+tls"
        self._server = _Server(self, f"{scheme}://{self.cfg.host}:{self.cfg.port}", **kwargs)

    def _refuse(self, why: str):
        self.refused += 1
        raise fl.FlightServerError(f"refused: {why}")

    def receive(self, command: bytes, reader, writer) -> None:
        start = time.perf_counter()
        try:
            header = msgpack.unpackb(command)
            if not isinstance(header, dict) or header.get("v") != VERSION:
                raise ValueError(f"bad header (wire version {VERSION} expected)")
            tid, part, parts = header.get("tid"), header.get("part", 0), header.get("parts", 1)
            if not isinstance(tid, str) or not tid or len(tid) > 256:
                raise ValueError("bad header (transfer id)")
            layout = KVLayout.from_dict(layout_dict(reader.schema))
            if type(parts) is not int or type(part) is not int or not 0 <= part < parts <= MAX_STREAMS:
                raise ValueError(f"bad part {part} of {parts}")
        except (ValueError, TypeError, LayoutError, msgpack.UnpackException, pa.ArrowException) as e:
            self._refuse(str(e))
        if layout.total_nbytes > self.cfg.max_transfer_bytes:
            self._refuse(f"declared {layout.total_nbytes} bytes over limit {self.cfg.max_transfer_bytes}")
        state = self._join(tid, layout, header.get("meta") or {}, part, parts, start)
        try:
            self._receive_part(state, part, reader)
        except Exception as e:
            self._fail(state, f"transfer failed: {e}")
            raise fl.FlightServerError(f"transfer {tid} failed: {e}") from None
        finally:
            self._leave(state)
        self._finish_part(state)
        writer.write(pa.py_buffer(b"ok"))

    def _join(self, tid, layout, meta, part, parts, start) -> _Incoming:
        with self._lock:
            state = self._incoming.get(tid)
            if state is None:
                if not self.table.begin(tid):
                    self._refuse(f"transfer {tid} is not expected (duplicate or aborted)")
                landing = self.land(tid, layout) if self.land else None
                state = self._incoming[tid] = _Incoming(tid, layout, meta, parts, landing, self.pool, start)
            elif state.layout != layout or state.parts != parts or state.error:
                self._refuse(f"part {part} of transfer {tid} does not match its other parts")
            if part in state.seen:
                self._refuse(f"part {part} of transfer {tid} arrived twice")
            state.seen.add(part)
            state.active += 1
        if state.landing is not None and part == 0:
            try:
                state.landing.kv.check()
            except ValueError as e:
                self._fail(state, f"landing does not fit: {e}")
                self._leave(state)
                raise fl.FlightServerError(f"transfer {tid} failed: {e}") from None
        return state

    def _leave(self, state: _Incoming) -> None:
        """A part stops writing; the memory of a failed transfer goes back once no part writes into it."""
        with state.cond:
            state.active -= 1
            release = state.error is not None and state.active == 0 and not state.released
            state.released = state.released or release
        if release:
            state.release()

    def _receive_part(self, state: _Incoming, part: int, reader) -> None:
        layout, n = state.layout, state.layout.tensor_nbytes
        layers = iter(range(part, layout.num_layers, state.parts))
        layer, at, dest, began = next(layers, None), 0, None, state.began
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            arrived = time.perf_counter()
            info = msgpack.unpackb(chunk.app_metadata.to_pybytes()) if chunk.app_metadata else {}
            began = min(began, self._sent_at(info.get("e"), arrived))
            batch = chunk.data
            if batch is None and layer is None and set(info) == {"e"}:
                continue  # the trailer: only its time
            if layer is None or batch is None or batch.num_columns != 2 or info.get("layer") != layer or info.get("at") != at:
                raise ValueError(f"run out of order: expected layer {layer} at {at}")
            size = batch.num_rows
            if at + size > n:
                raise ValueError(f"run of {size} bytes past the end of layer {layer}")
            if state.landing is None and at == 0 and size == n and aligned(batch, layout.itemsize):
                state.kept[layer] = batch
            else:
                t0 = time.perf_counter()
                dest = state.target(layer) if at == 0 or dest is None else dest
                for column, into in zip(batch.columns, dest):
                    data = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=size, offset=column.offset)
                    self._write(into, at, data)
                with state.cond:
                    state.phases.deserialize += (time.perf_counter() - t0) * 1e3
            t = info.get("t")
            if isinstance(t, list) and len(t) == 3:
                with state.cond:
                    state.sender = [max(a, float(b)) for a, b in zip(state.sender, t)]
            at += size
            if at == n:
                layer, at, dest = next(layers, None), 0, None
            if state.error or self.table.status(state.tid) == TransferStatus.ABORTED:
                raise ConnectionError(state.error or "aborted by receiver")
        if layer is not None:
            raise ValueError(f"part {part} ended before layer {layer} of {layout.num_layers}")
        with state.cond:
            state.began = min(state.began, began)

    @staticmethod
    def _sent_at(sent_after_ms, arrived: float) -> float:
        """The latest the transfer can have begun, as one batch proves: it left the sender ``sent_after_ms`` into
        the transfer and arrived no earlier (this takes in the call's setup, which the handler's clock misses)."""
        if isinstance(sent_after_ms, float) and 0 <= sent_after_ms < 1e7:
            return arrived - sent_after_ms / 1e3
        return arrived

    def _finish_part(self, state: _Incoming) -> None:
        with state.cond:
            state.finished += 1
            last = state.finished == state.parts
        if last:
            try:
                result = self._result(state)
            except Exception as e:
                self._fail(state, f"transfer failed: {e}")
                raise fl.FlightServerError(f"transfer {state.tid} failed: {e}") from None
            with self._lock:
                self._incoming.pop(state.tid, None)
            self.table.done(state.tid, result)
            with state.cond:
                state.cond.notify_all()
            return
        with state.cond:
            state.cond.wait_for(lambda: state.error or state.finished == state.parts, self.cfg.timeout_s)
            error = state.error or (None if state.finished == state.parts else "its other parts never arrived")
        if error:
            self._fail(state, error)
            raise fl.FlightServerError(f"transfer {state.tid} failed: {error}")

    def _fail(self, state: _Incoming, error: str) -> None:
        with state.cond:
            first = state.error is None
            state.error = state.error or error
            state.cond.notify_all()
            release = first and state.active == 0 and not state.released
            state.released = state.released or release
        if first:
            with self._lock:
                self._incoming.pop(state.tid, None)
            self.table.fail(state.tid, error)
        if release:
            state.release()

    def _result(self, state: _Incoming) -> ReceivedKV:
        layout, phases = state.layout, state.phases
        if state.landing is None:
            t0 = time.perf_counter()
            views = self._views(layout, state.kept, state.buf)
            phases.deserialize += (time.perf_counter() - t0) * 1e3
        elapsed = (time.perf_counter() - state.began) * 1e3
        phases.d2h, phases.serialize, computing = state.sender
        phases.wire = max(0.0, elapsed - phases.deserialize - phases.d2h - phases.serialize - computing)
        if state.landing is not None:
            return ReceivedKV(state.tid, layout, None, phases, state.landing.release, state.meta, landed=state.landing.kv)
        buf, pool = state.buf, self.pool
        return ReceivedKV(state.tid, layout, None, phases, (lambda: pool.release(buf)) if buf is not None else
                          (lambda: None), state.meta, layers=views)

    @staticmethod
    def _views(layout: KVLayout, kept: list, buf) -> list:
        """Typed ``(k, v)`` per layer: over the received Arrow buffers where a layer came whole (they live as long
        as the tensors), else views of the pooled copy (valid until release)."""
        dtype, out = TORCH_DTYPES[layout.dtype], []
        copied = unpack(buf, layout) if buf is not None else None
        for i, batch in enumerate(kept):
            if batch is None:
                out.append(copied[i])
                continue
            pair = []
            for column in batch.columns:
                data = column.buffers()[1]
                raw = (ctypes.c_char * layout.tensor_nbytes).from_address(data.address + column.offset)
                raw.owner = data  # the tensor keeps raw alive, raw the received Arrow buffer
                pair.append(torch.frombuffer(raw, dtype=dtype).view(layout.tensor_shape))
            out.append(tuple(pair))
        return out

    @staticmethod
    def flat(kv: PiecewiseKV, layer: int) -> tuple:
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
