"""Decode worker process (and the colocated baseline).

``decode{rid, first_token, prompt_ids, emitted, params}`` arrives from the
router once prefill answered; the KV for ``rid`` arrives independently over
the transport. Whichever comes second starts the sequence. Every engine tick
advances each active sequence by one token, so all requests in flight make
progress together. Tokens go out as ``tokens`` messages, the last as ``done``
with the transfer phases and decode timing. In colocated mode the worker also
accepts ``generate``: it runs the prefill itself and keeps the KV in place.

Admission: each sequence reserves ``(prompt + max new tokens) x bytes per
token`` of the KV budget when it is accepted; a request that does not fit is
refused with 503 and ``retry_after`` (the router queues before that happens,
from the budget this worker reports). The transport's buffer pool is capped
by the same budget."""
from __future__ import annotations

import logging
import os
import time

from control.worker import WorkerLoop
from engine import EngineConfig, RequestError, SamplingParams
from engine.requests import first_message, new_sequence, run_prefill
from engine.runner import ModelRunner
from engine.sequence import Sequence
from kvtransfer import TransferError, TransferStatus, TransportConfig, make_receiver
from kvtransfer.tensors import materialize

log = logging.getLogger(__name__)


class Active:
    __slots__ = ("seq", "started", "received")

    def __init__(self, seq, received=None):
        self.seq = seq
        self.started = time.perf_counter()
        self.received = received

    def release(self):
        if self.received is not None:
            self.received.release()


class DecodeWorker(WorkerLoop):
    role = "decode"

    def __init__(self, engine: EngineConfig, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 kv_port: int = 0, colocated: bool = False, transport_cfg: TransportConfig | None = None,
                 kv_budget_bytes: int = 0, drain_s: float = 20.0):
        super().__init__(host, port, drain_s, transport_cfg.token if transport_cfg else None)
        self.runner = ModelRunner(engine)
        self.kv_budget = kv_budget_bytes or default_budget(self.runner.device)
        self.reserved: dict[str, int] = {}
        self.completed = 0
        self.colocated = colocated
        self.role = "colocated" if colocated else "decode"
        self.transport = None if colocated else transport
        self.receiver = None
        if not colocated:
            cfg = transport_cfg or TransportConfig(host=host, port=kv_port)
            cfg.pool_bytes = min(cfg.pool_bytes, self.kv_budget)
            self.receiver = make_receiver(transport, cfg)
            self.receiver.on_complete = lambda tid, status: self.inbox.put({"op": "_kv", "rid": tid})
            self.receiver.start()
            self.kv_timeout = cfg.timeout_s
        self.waiting: dict[str, tuple[dict, float]] = {}
        self.active: dict[str, Active] = {}

    def info(self):
        return {"role": self.role, "model": self.runner.name, "transport": self.transport,
                "kv_addr": self.receiver.address if self.receiver else None, "max_len": self.runner.max_len,
                "active": len(self.active), "waiting": len(self.waiting), "completed": self.completed,
                "kv_registrations": getattr(self.receiver, "registrations", 0),
                "kv_budget_bytes": self.kv_budget, "kv_bytes_per_token": self.runner.kv_bytes_per_token,
                "kv_reserved_bytes": sum(self.reserved.values()),
                "kv_pool_bytes_in_use": getattr(getattr(self.receiver, "pool", None), "bytes_in_use", 0)}

    def busy(self):
        return bool(self.active)

    def idle(self):
        return super().idle() and not self.waiting

    def _reserve(self, rid, prompt_len, params) -> bool:
        max_new = params.max_tokens if params.max_tokens else self.runner.max_len
        need = min(self.runner.max_len, prompt_len + max_new) * self.runner.kv_bytes_per_token
        used = sum(self.reserved.values())
        if used + need > self.kv_budget:
            self.fail(rid, 503, f"decode KV budget full: {used} of {self.kv_budget} bytes reserved, "
                                f"{need} more needed", retry_after=1)
            return False
        self.reserved[rid] = need
        return True

    def _finish(self, rid):
        act = self.active.pop(rid, None)
        if act:
            act.release()
        self.reserved.pop(rid, None)

    def handle(self, msg):
        op, rid = msg["op"], msg["rid"]
        if op == "decode" and not self.colocated:
            self.waiting[rid] = (msg, time.monotonic() + self.kv_timeout)
            self._try_start(rid)
        elif op == "_kv":
            if rid in self.waiting:
                self._try_start(rid)
        elif op == "generate" and self.colocated:
            self._generate(msg)
        elif op == "abort":
            self._abort(rid)
        else:
            self.fail(rid, 400, f"{self.role} worker does not handle {op!r}")

    def _try_start(self, rid):
        status = self.receiver.poll(rid)
        if status in (TransferStatus.PENDING, TransferStatus.RECEIVING):
            return
        msg, _ = self.waiting.pop(rid)
        try:
            received = self.receiver.wait(rid, 0)
        except (TransferError, TimeoutError) as e:
            return self.fail(rid, 502, f"KV transfer failed: {e}")
        try:
            params = SamplingParams.from_dict(msg["params"], resolved=True)
            seq = Sequence.resume(rid, msg["prompt_ids"], msg["first_token"], msg["emitted"], params,
                                  self.runner.tokenizer, self.runner.max_len)
        except (KeyError, TypeError, RequestError) as e:
            received.release()
            return self.fail(rid, 400, f"bad decode request: {e}")
        if not self._reserve(rid, len(seq.prompt_ids), params):
            return received.release()
        seq.cache = self.runner.cache_from(materialize(received, self.runner.device))
        self.active[rid] = Active(seq, received)

    def _generate(self, msg):
        rid = msg["rid"]
        try:
            seq = new_sequence(self.runner, rid, msg)
        except RequestError as e:
            return self.fail(rid, e.status, str(e))
        if not self._reserve(rid, len(seq.prompt_ids), seq.params):
            return
        text, kv, prefill_ms = run_prefill(self.runner, seq)
        self.emit(rid, "first", **first_message(seq, text, prefill_ms, 0.0))
        if seq.finished:
            self.reserved.pop(rid, None)
            self.reply_to.pop(rid, None)
            return
        seq.cache = self.runner.cache_from(kv)
        self.active[rid] = Active(seq)

    def _abort(self, rid):
        self.waiting.pop(rid, None)
        self._finish(rid)
        self.reply_to.pop(rid, None)
        if self.receiver:
            self.receiver.abort(rid)

    def tick(self):
        now = time.monotonic()
        for rid, (_, deadline) in list(self.waiting.items()):
            if deadline < now:
                del self.waiting[rid]
                self.receiver.abort(rid)
                self.fail(rid, 504, f"KV for {rid} did not arrive within {self.kv_timeout:.0f}s")
        for rid, act in list(self.active.items()):
            seq = act.seq
            try:
                text = seq.accept(self.runner.step(seq.cache, seq.output_ids[-1]))
            except Exception as e:
                log.exception("decode step failed for %s", rid)
                self._finish(rid)
                self.fail(rid, 500, f"decode failed: {e}")
                continue
            if seq.finished:
                self._finish(rid)
                self.completed += 1
                decode_ms = (time.perf_counter() - act.started) * 1e3
                phases = act.received.phases.to_dict() if act.received else None
                self.emit(rid, "done", ids=[seq.output_ids[-1]], text=text, finish_reason=seq.finish_reason,
                          completion_tokens=len(seq.output_ids), timing={"decode": decode_ms}, phases=phases,
                          logprobs=seq.take_logprobs())
            else:
                self.emit(rid, "tokens", ids=[seq.output_ids[-1]], text=text, logprobs=seq.take_logprobs())

    def close(self):
        if self.receiver:
            self.receiver.close()
        super().close()


def default_budget(device) -> int:
    """Half of the memory free at startup (host RAM, or the GPU's)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
