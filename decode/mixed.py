"""A mixed worker (``pdserve decode --role mixed``): a decode worker that also
prefills prompts for other decode workers.

It is everything a decode worker is (KV received from prefill workers,
prompts of its own through ``generate``) and it also takes ``prefill`` as a
prefill worker does: the prompt runs in this engine's steps next to its
decoding sequences (under the same per-step prompt-token cap), its first
token goes to the router, and its KV is pushed to ``kv_dest`` by a sender
thread after the forward: from the pool blocks where the transport takes
pieces (freed when the push ends), else copied out once and freed at once.
No layer-wise streaming here: a streamed push would hold the decode steps'
one-step-ahead overlap back. ``pdserve up --mixed N`` lists each mixed worker
as both a prefill and a decode worker of the router, which sends a prompt
whose decode worker would also be its prefill worker through ``generate``.

One rank (``--tp 1``), a paged torch engine, and a transport whose sender and
receiver can live in one process: any but mlx's fixed world (nccl's ends pair up
as they meet, so a mixed worker sends to and receives from each peer over pairs
of its own)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from engine import RequestError
from engine.requests import first_message, new_sequence
from kvtransfer import PiecewiseKV, PoolRows, TransferError, TransportConfig, make_sender
from prefill.cached import prompt_cache
from prefill.pushes import kv_suffix, push_ended

from .worker import DecodeWorker

log = logging.getLogger(__name__)

FIXED_WORLDS = ("mlx",)


class MixedWorker(DecodeWorker):
    role = "mixed"

    def __init__(self, engine, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0, kv_port: int = 0,
                 transport_cfg: TransportConfig | None = None, kv_budget_bytes: int = 0, drain_s: float = 20.0,
                 send_threads: int = 2):
        if engine.tp > 1 or engine.pp > 1 or transport in FIXED_WORLDS or engine.engine == "mlx":
            raise ValueError(f"--role mixed runs one rank (--tp 1, --pp 1) of the torch engine with a transport other than "
                             f"{' and '.join(FIXED_WORLDS)} (got --tp {engine.tp}, --transport {transport}, "
                             f"--engine {engine.engine})")
        super().__init__(engine, transport, host, port, kv_port, False, transport_cfg, kv_budget_bytes, drain_s)
        self.role = "mixed"
        cfg = transport_cfg or TransportConfig(host=host)
        self.sender = make_sender(transport, TransportConfig(host=host, timeout_s=cfg.timeout_s, token=cfg.token,
                                                             options=dict(cfg.options)))
        if self.pool_memory is not None:
            self.sender.share(self.pool_memory)
        self.senders = ThreadPoolExecutor(send_threads, thread_name_prefix="kv-send")
        self.for_others: dict[str, tuple] = {}  # rid -> (seq, kv_dest, skip keys, received at)
        self.sending: dict[str, object] = {}  # rid -> seq whose blocks a push reads
        self.prefilled_for_others = 0

    def info(self):
        return {**super().info(), "prefilled_for_others": self.prefilled_for_others,
                "queued": len(self.for_others), "pushing": len(self.sending)}

    def busy(self):
        return super().busy() or bool(self.for_others) or bool(self.sending)

    def handle(self, msg):
        op, rid = msg["op"], msg["rid"]
        if op == "prefill":
            return self._prefill(msg) if self.grammars.ready(msg) else None
        if op == "_sent":
            return push_ended(self, msg)
        if op == "abort" and rid in self.for_others:
            self.engine.free(self.for_others.pop(rid)[0])
            self.reply_to.pop(rid, None)
            return
        super().handle(msg)

    def on_abort(self, rid):
        if rid in self.sending:  # (server thread) a push to a decode worker that is gone would wait out its timeout
            self.sender.cancel(rid)

    def _finish(self, rid):
        entry = self.for_others.pop(rid, None)  # refused by the engine (too long for the pool)
        if entry is not None:
            self.engine.free(entry[0])
        super()._finish(rid)

    def after_step_error(self):
        super().after_step_error()
        for rid, entry in list(self.for_others.items()):
            del self.for_others[rid]
            self.engine.free(entry[0])
            self.fail(rid, 500, "prefill failed: the engine step failed")

    def _prefill(self, msg):
        rid, dest = msg["rid"], msg.get("kv_dest")
        if not isinstance(dest, str):
            return self.fail(rid, 400, "a mixed worker prefills for one decode worker (kv_dest: an address)")
        try:
            seq = new_sequence(self.engine, rid, msg)
        except RequestError as e:
            return self.fail(rid, e.status, str(e))
        seq.hold_after_first = True
        skip = msg.get("kv_skip")
        self.for_others[rid] = (seq, dest, skip if isinstance(skip, list) else [], time.perf_counter())
        self.engine.add(seq)

    def _emit(self, tok):
        seq = tok.seq
        entry = self.for_others.pop(seq.rid, None)
        if entry is None:
            return super()._emit(tok)
        _, dest, skip, received = entry
        now, scheduled = time.perf_counter(), seq.scheduled_at or received
        self.emit(seq.rid, "first", **first_message(tok, (now - scheduled) * 1e3, (scheduled - received) * 1e3),
                  kv_tp=1, **prompt_cache(seq))
        if seq.finished:
            self.engine.free(seq)
            self.reply_to.pop(seq.rid, None)
            return
        self.prefilled_for_others += 1
        self._push_from(seq, dest, skip)

    def _push_from(self, seq, dest, skip):
        """Send the prompt's KV (less the blocks the decode worker holds) from the blocks, or a copy of them."""
        layout, table, _ = kv_suffix(self.engine, seq, skip)
        if self.sender.takes_pieces(self.engine.device):
            kv = PiecewiseKV(layout, PoolRows(*self.engine.rows(table, layout.num_tokens)))
            self.sending[seq.rid] = seq
        else:
            try:
                kv = self.engine.pool.gather(table, layout.num_tokens)
            finally:
                self.engine.free(seq)
        self.senders.submit(self._push, seq.rid, dest, layout, kv)

    def _push(self, rid, dest, layout, kv):
        """(Sender thread)"""
        sent, start = False, time.perf_counter()
        try:
            phases = self.sender.send(dest, rid, layout, kv)
            stream = {"streamed": False, "overlap": 0.0, "exposed": (time.perf_counter() - start) * 1e3}
            self.emit(rid, "kv_sent", phases=phases.to_dict(), stream=stream)
            sent = True
        except TransferError as e:
            log.warning("KV push for %s failed: %s", rid, e)
            self.fail(rid, 502, f"KV transfer to decode failed: {e}", stage="kv_send")
        except Exception as e:
            log.exception("KV push for %s failed", rid)
            self.fail(rid, 500, f"KV push failed: {e}", stage="kv_send")
        finally:
            self.inbox.put({"op": "_sent", "rid": rid, "ok": sent})

    def close(self):
        self.senders.shutdown(wait=False, cancel_futures=True)
        self.sender.close()
        super().close()
