"""Prefill worker process.

For each ``prefill`` request: build the sequence, run the prompt forward,
send ``first`` (token + text) to the router immediately, then push the KV to
the decode worker at ``kv_dest`` over the configured transport, in a sender
thread so the next prompt can start. A failed push answers ``error``; a
successful one ``kv_sent`` with the sender-side phases. Where the transport
owns memory it can send from without a copy (``alloc``: a registered NIXL
slab, an MLX array), the forward pass writes the prompt's KV straight there.

Bounds: at most ``max_queue`` prompts wait (more are refused with 503 and
``retry_after``); KV waiting to be pushed is held at most ``lease_s`` (then
the request fails with 504 and the KV is dropped)."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from control.worker import WorkerLoop
from engine import EngineConfig, RequestError
from engine.requests import first_message, new_sequence, run_prefill
from engine.runner import ModelRunner
from kvtransfer import KVLayout, TransferError, TransportConfig, make_sender
from kvtransfer.tensors import dtype_name, layout_of

log = logging.getLogger(__name__)


class PrefillWorker(WorkerLoop):
    role = "prefill"

    def __init__(self, engine: EngineConfig, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 transport_cfg: TransportConfig | None = None, send_threads: int = 4, max_queue: int = 64,
                 drain_s: float = 20.0):
        self.cfg = transport_cfg or TransportConfig(host=host)
        super().__init__(host, port, drain_s, self.cfg.token)
        self.runner = ModelRunner(engine)
        self.transport = transport
        self.sender = make_sender(transport, self.cfg)
        self.max_queue = max_queue
        self.queued = 0
        self.pushing = 0
        self.held_bytes = 0
        self.kv_in_place = 0
        self._count_lock = threading.Lock()
        self.senders = ThreadPoolExecutor(send_threads, thread_name_prefix="kv-send")
        self.aborted: set[str] = set()
        self.received_at: dict[str, float] = {}

    def info(self):
        return {"role": self.role, "model": self.runner.name, "transport": self.transport, "max_len": self.runner.max_len,
                "kv_registrations": getattr(self.sender, "registrations", 0), "queued": self.queued,
                "pushing": self.pushing, "kv_held_bytes": self.held_bytes, "kv_in_place": self.kv_in_place,
                "kv_staged_bytes": self.sender.staged_bytes}

    def idle(self):
        return super().idle() and self.pushing == 0

    def _count(self, name, delta):
        with self._count_lock:
            setattr(self, name, getattr(self, name) + delta)

    def _on_message(self, identity, msg):
        op, rid = msg.get("op"), msg.get("rid")
        if op == "abort":
            self.aborted.add(rid)
        elif op == "prefill" and isinstance(rid, str):
            if self.queued >= self.max_queue:
                self.server.send(identity, "error", rid=rid, status=503, retry_after=1,
                                 message=f"prefill queue full ({self.max_queue} waiting)")
                return
            self._count("queued", 1)
            self.received_at[rid] = time.perf_counter()
        super()._on_message(identity, msg)

    def handle(self, msg):
        rid = msg["rid"]
        queued_at = self.received_at.pop(rid, time.perf_counter())
        if msg["op"] == "abort":
            if rid not in self.reply_to:
                self.aborted.discard(rid)
            return
        if msg["op"] != "prefill":
            return self.fail(rid, 400, f"prefill worker does not handle {msg['op']!r}")
        self._count("queued", -1)
        if rid in self.aborted:
            self.aborted.discard(rid)
            self.reply_to.pop(rid, None)
            return
        try:
            seq = new_sequence(self.runner, rid, msg)
        except RequestError as e:
            return self.fail(rid, e.status, str(e))
        queue_ms = (time.perf_counter() - queued_at) * 1e3
        source = self._source(len(seq.prompt_ids))
        try:
            text, kv, prefill_ms = run_prefill(self.runner, seq, source.layers if source else None)
            self.emit(rid, "first", **first_message(seq, text, prefill_ms, queue_ms))
            if seq.finished:
                self.reply_to.pop(rid, None)
                return
            dest = msg.get("kv_dest")
            if not isinstance(dest, str):
                return self.fail(rid, 500, "prefill request has no kv_dest")
            if source is not None and all(a.data_ptr() == b.data_ptr() for pair, placed in zip(kv, source.layers)
                                          for a, b in zip(pair, placed)):
                self.kv_in_place += 1
                kv = source
            layout = source.layout if kv is source else layout_of(kv)
            self._count("pushing", 1)
            self._count("held_bytes", layout.total_nbytes)
            self.senders.submit(self._push, rid, dest, layout, kv, time.monotonic(), source)
            source = None
        finally:
            if source is not None:
                source.release()

    def _source(self, tokens: int):
        layers, heads, head_dim = self.runner.kv_shape
        layout = KVLayout(layers, heads, head_dim, tokens, dtype_name(self.runner.dtype))
        return self.sender.alloc(layout, str(self.runner.device))

    def _push(self, rid, dest, layout, kv, created, source):
        try:
            if rid in self.aborted:
                self.aborted.discard(rid)
                self.reply_to.pop(rid, None)
                return
            if time.monotonic() - created > self.cfg.lease_s:
                return self.fail(rid, 504, f"KV lease of {self.cfg.lease_s:.0f}s expired before the transfer started")
            try:
                phases = self.sender.send(dest, rid, layout, kv)
            except TransferError as e:
                log.warning("KV push for %s failed: %s", rid, e)
                return self.fail(rid, 502, f"KV transfer to decode failed: {e}")
            self.emit(rid, "kv_sent", phases=phases.to_dict())
            self.reply_to.pop(rid, None)
        finally:
            if source is not None:
                source.release()
            self._count("held_bytes", -layout.total_nbytes)
            self._count("pushing", -1)

    def close(self):
        self.senders.shutdown(wait=False, cancel_futures=True)
        self.sender.close()
        super().close()
