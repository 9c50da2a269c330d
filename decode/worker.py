"""Decode worker process (and the colocated baseline).

``decode{rid, first_token, prompt_ids, emitted, params}`` arrives from the
router once prefill answered; the KV for ``rid`` arrives independently over
the transport. Whichever comes second starts the sequence. A transport that
lands pieces (tcp with the pool in host memory, nccl with it on its GPU)
gets blocks of the engine's paged pool when the transfer begins and receives the bytes straight into
them; otherwise the KV is copied from the transport's buffer into blocks
(``h2d`` in the phases) and the buffer goes back at once. Every engine step advances all
running sequences together in one batched forward (continuous batching):
tokens go out as ``tokens`` messages, the last as ``done`` with the transfer
phases and decode timing; what one step emits for one router travels as one
``batch``. The worker also accepts ``generate`` (colocated mode, and local
prefill when the router's ``--disagg`` is auto or never): the same engine
prefills the prompt (in chunks, mixed with the decode steps of the others,
at most ``--step-prefill-tokens`` or what ``--slo-tpot-ms`` allows per step
that decodes: ``engine.step_budget``) and answers ``first`` itself.

Admission: each sequence reserves the blocks of ``prompt + max new tokens``
when it is accepted; a request that does not fit is refused with 503 and
``retry_after`` (the router queues before that happens, from the budget this
worker reports). KV that arrives while the pool is short waits for blocks."""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from control.worker import WorkerLoop, fixed_world
from engine import EngineConfig, RequestError
from engine.factory import make_engine
from engine.guided.background import Background
from engine.step_profiler import attach as attach_profiler
from engine.requests import first_message, pp_timing, resumed_sequence
from kvtransfer import (KVLayout, Landing, PiecewiseKV, PoolRows, TransferError, TransferStatus, TransportConfig,
                        make_receiver)
from kvtransfer import spec as transport_spec
from kvtransfer.convert import convert, needs_convert
from kvtransfer.tensors import unpack
from prefill.cached import prompt_cache

from . import holds, local, pp_kv, precopy
from .group_receive import GroupReceive
from .migrate import OPS as MOVE_OPS, Moves
from .report import report

log = logging.getLogger(__name__)


class Live:
    __slots__ = ("seq", "started", "phases", "colocated")

    def __init__(self, seq, phases=None, colocated=False):
        self.seq = seq
        self.started = time.perf_counter()
        self.phases = phases
        self.colocated = colocated


class DecodeWorker(WorkerLoop):
    role = "decode"

    def __init__(self, engine: EngineConfig, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 kv_port: int = 0, colocated: bool = False, transport_cfg: TransportConfig | None = None,
                 kv_budget_bytes: int = 0, drain_s: float = 20.0):
        super().__init__(host, port, drain_s, transport_cfg.token if transport_cfg else None)
        if not colocated:
            fixed_world(transport, engine)
        if kv_budget_bytes:
            engine.kv_budget_bytes = kv_budget_bytes
        self.shared_pool = self.pool_memory = None
        self.transport = None if colocated else transport
        shares = transport in ("shm", "nixl") and not colocated
        cfg = transport_cfg or TransportConfig(host=host, port=kv_port)
        ranks_kv = None if colocated else ("decode.tp_kv:DecodeRankKV",
                                           {transport_spec.ENV: transport_spec.dump(transport, cfg)})
        self.engine = make_engine(engine, pool_memory=self._transport_pool if shares else None, tp_kv=ranks_kv)
        self.watch_group(self.engine)
        attach_profiler(self.engine, self.role)
        getattr(self.engine, "warm_up", lambda: None)()  # before on_schedule is set and before ready
        self.prefix_blocks = self.engine.blocks if self.engine.blocks.caching else None
        self.kv_budget = self.engine.kv_capacity_bytes
        self.reserved: dict[str, int] = {}
        self.completed = 0
        self.colocated = colocated
        self.role = "colocated" if colocated else "decode"
        self.receiver = self.group_kv = None
        self.adopting: dict = {}
        if not colocated:
            cfg.pool_bytes = min(cfg.pool_bytes, self.kv_budget)
            # a transfer this engine could hold is never refused: one sequence's KV at the model's whole context
            full_context = self.engine.max_len * getattr(self.engine, "kv_bytes_per_token", 0)
            cfg.max_transfer_bytes = max(cfg.max_transfer_bytes, full_context)
            if transport == "nccl":  # the transport's GPU is the engine's
                cfg.options.setdefault("device", str(self.engine.device))
            self.receiver = make_receiver(transport, cfg)
            self.receiver.on_complete = lambda tid, status: self.inbox.put({"op": "_kv", "rid": tid})
            if self.shared_pool is not None:
                self.receiver.share(self.shared_pool)
            elif self.pool_memory is not None:
                self.receiver.share(self.pool_memory)
            if getattr(self.engine, "paged", True) and self.receiver.lands_on(self.engine.device):
                self.receiver.land = self._land
            self.receiver.start()
            self.kv_timeout = cfg.timeout_s
            self.group_kv = GroupReceive(self)
        self.waiting: dict[str, tuple[dict, float]] = {}
        self.blocked: deque = deque()
        self.live: dict[str, Live] = {}
        self.landing: dict[str, list] = {}
        self.held: dict[str, tuple[list, float]] = {}
        self.precopied: set[str] = set()  # rids whose hold is the blocks their move sent ahead (decode.precopy)
        self.kv_landed = self.kv_converted = 0
        self.local_prefills = 0  # prompts computed here (generate) by a decode worker of a disaggregated cluster
        self.grammars = Background(self.engine, self.inbox.put, lambda rid: rid in self.reply_to)
        self.moves = Moves(self, self.transport, cfg)  # sequences moved to other decode workers (decode.migrate)

    def info(self):
        return report(self)

    def busy(self):
        return bool(self.live) or bool(self.blocked)

    def idle(self):
        return super().idle() and not self.waiting

    def reserve_budget(self, rid, prompt_len, params) -> bool:
        e = self.engine
        if prompt_len + params.max_tokens > e.max_len:  # a smaller pool than its prefill worker's: elsewhere
            self.fail(rid, 503, f"the request needs {prompt_len + params.max_tokens} tokens of context; this "
                                f"worker holds at most {e.max_len}", retry_after=1)
            return False
        need = e.blocks.blocks_for(prompt_len + params.max_tokens) * e.block_bytes
        used = sum(list(self.reserved.values()))
        if used + need > self.kv_budget:
            self.fail(rid, 503, f"decode KV budget full: {used} of {self.kv_budget} bytes reserved, "
                                f"{need} more needed", retry_after=1)
            return False
        self.reserved[rid] = need
        return True

    def _finish(self, rid):
        live = self.live.pop(rid, None)
        if live:
            self.engine.free(live.seq)
        self.reserved.pop(rid, None)

    def forget(self, rid):
        """``rid`` ends here without a word more to the router (moved to another worker)."""
        self._finish(rid)
        self.reply_to.pop(rid, None)

    def handle(self, msg):
        op, rid = msg["op"], msg["rid"]
        if op in ("decode", "generate", "prefill") and not self.grammars.ready(msg):
            return  # back once its grammar is compiled (engine.guided.background)
        if op == "decode" and not self.colocated:
            self.waiting[rid] = (msg, time.monotonic() + self.kv_timeout)
            self._try_start(rid)
        elif op == "_kv" and rid.endswith(precopy.SUFFIX):
            precopy.arrived(self, rid)
        elif op == "_kv":
            rid = rid.split(":h")[0].split(":L")[0]  # a slice of a request's KV (tp_kv), a range of layers (pp_kv)
            if rid in self.waiting:
                self._try_start(rid)
        elif op == "_adopted":
            self.group_kv.finish(rid)
        elif op == "generate":
            local.generate(self, msg)
        elif op == "hold" and not self.colocated:
            holds.hold(self, rid, msg.get("keys"))
        elif op == "abort":
            self._abort(rid)
        elif op in MOVE_OPS:
            self.moves.handle(msg)
        else:
            self.fail(rid, 400, f"{self.role} worker does not handle {op!r}")

    def _prefix(self, rid, seq, kv_tokens) -> list[int]:
        return holds.prefix(self, rid, seq, kv_tokens)

    def _transport_pool(self, nbytes: int, device):
        """The KV pool in host memory the transport writes into: a shared-memory file (shm), NIXL-registered (nixl)."""
        if device.type != "cpu":
            return None
        if self.transport == "shm":
            from kvtransfer.transports.shm import SharedMemory

            self.shared_pool = SharedMemory(nbytes)
            return self.shared_pool.tensor
        self.pool_memory = torch.zeros(nbytes, dtype=torch.uint8)
        return self.pool_memory

    def _land(self, tid: str, layout: KVLayout):
        """(Receiver thread) Blocks for an arriving KV, so its bytes land where decode will read them."""
        layers, heads, head_dim = self.engine.kv_shape if getattr(self.engine, "stage", None) is None else (0, 0, 0)
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (layers, heads, head_dim) or ":L" in tid \
                or needs_convert(layout, self.engine.kv_dtype, self.engine.kv_scales) or tid in self.landing:
            return None
        table = self.engine.reserve(layout.num_tokens)
        if table is None:
            return None
        self.landing[tid] = table

        def release():
            held = self.landing.pop(tid, None)
            if held is not None:
                self.engine.release(held)
        return Landing(PiecewiseKV(layout, PoolRows(*self.engine.rows(table, layout.num_tokens))), release)

    def start_live(self, seq, phases) -> None:
        self.kv_landed += 1
        self.live[seq.rid] = Live(seq, phases)

    def _try_start(self, rid):
        msg = self.waiting[rid][0]
        if pp_kv.spans_of(msg) is not None and not getattr(self.engine, "paged", True):  # joined, for mlx
            return pp_kv.try_start(self, rid)
        if getattr(self.engine, "stage", None) is not None and msg.get("kv_tp", 1) != 1 and msg.get("kv_pp") is None:
            self.waiting.pop(rid)
            return self.fail(rid, 400, "a tensor-parallel prefill sends a pipelined decode worker its KV by layer "
                                       "range (kv_pp; it takes the stages from kv_stages): this one did not")
        if GroupReceive.sliced(msg, self.engine):
            return self.group_kv.try_start(rid)
        if getattr(self.engine, "stage", None) is not None and self.engine.kv_scales:
            self.waiting.pop(rid)
            self.receiver.abort(rid)
            return self.fail(rid, 400, "a pipelined decode worker with an FP8 KV cache takes KV by layer range, each "
                                       "stage with its scales (from a torch prefill worker), not whole")
        status = self.receiver.poll(rid)
        if status in (TransferStatus.PENDING, TransferStatus.RECEIVING) or not precopy.ready(self, rid, msg):
            return
        msg, _ = self.waiting.pop(rid)
        try:
            received = self.receiver.wait(rid, 0)
        except (TransferError, TimeoutError) as e:
            return self.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
        early = (received.meta or {}).get("d2h_ms")  # the sender's copy out of its engine before the transfer began
        if isinstance(early, (int, float)) and 0 <= early < 1e6:
            received.phases.d2h += float(early)
        resumed = self._resume(rid, msg, received, received.layout.num_tokens)
        if resumed is None:
            return
        seq, prefix = resumed
        if received.landed is not None:
            table = self.landing.pop(rid, None)
            if table is None:
                self.reserved.pop(rid, None)
                self.engine.release(prefix)
                return self.fail(rid, 502, "KV landed but its blocks were released")
            self.engine.adopt(seq, prefix + table)
            self.kv_landed += 1
            self.live[rid] = Live(seq, received.phases)
            return
        if received.layers is not None:
            views = received.layers
        else:
            with received.phases.measure("deserialize"):
                views = unpack(received.buffer, received.layout)
        if needs_convert(received.layout, self.engine.kv_dtype, self.engine.kv_scales):  # another dtype, or FP8
            with received.phases.measure("convert"):
                views = convert(views, received.layout, self.engine.kv_dtype, self.engine.kv_scales)
            self.kv_converted += 1
        self.blocked.append((seq, received, views, prefix))
        self._admit_blocked()

    def _resume(self, rid, msg, received, tokens: int):
        """``(sequence, held prefix blocks)`` of a ``decode`` message whose KV of ``tokens`` tokens is in, its KV
        budget reserved; None after failing the request (``received`` released)."""
        try:
            seq = resumed_sequence(self.engine, rid, msg["prompt_ids"], msg["first_token"], msg["emitted"],
                                   msg["params"], msg.get("earlier"))
            prefix = self._prefix(rid, seq, tokens)
        except (KeyError, TypeError, RequestError) as e:
            received.release()
            self.fail(rid, 400, f"bad decode request: {e}")
            return None
        if not self.reserve_budget(rid, len(seq.prompt_ids), seq.params):
            self.engine.release(prefix)
            received.release()
            return None
        return seq, prefix

    def admit(self, rid, msg, received, views, tokens: int) -> None:
        """KV that is in and in the pool's dtype (``views``: every layer) into the queue for blocks."""
        resumed = self._resume(rid, msg, received, tokens)
        if resumed is not None:
            self.blocked.append((resumed[0], received, views, resumed[1]))
            self._admit_blocked()

    def _admit_blocked(self):
        while self.blocked:
            seq, received, views, prefix = self.blocked[0]
            with received.phases.measure("h2d"):
                placed = self.engine.add_prefilled(seq, views, prefix)
            if not placed:
                return
            self.blocked.popleft()
            received.release()
            self.live[seq.rid] = Live(seq, received.phases)

    def start_local(self, seq) -> None:
        self.live[seq.rid] = Live(seq, colocated=True)
        self.local_prefills += not self.colocated

    def _abort(self, rid):
        self.drop_wait(rid)
        self.moves.drop(rid)
        self.forget(rid)

    def drop_wait(self, rid) -> None:
        """Whatever ``rid`` holds here on its way in (a wait for its KV, blocks held or landing), let go."""
        msg = self.waiting.pop(rid, (None,))[0]
        if self.group_kv is not None and (rid in self.adopting or (msg and GroupReceive.sliced(msg, self.engine))):
            split = self.adopting[rid][3] if rid in self.adopting else GroupReceive.split(msg, self.engine)
            self.group_kv.abort(rid, split or {"kv_tp": 1})
        for entry in [b for b in self.blocked if b[0].rid == rid]:
            self.blocked.remove(entry)
            entry[1].release()
            self.engine.release(entry[3])
            self.reserved.pop(rid, None)
        held = self.held.pop(rid, None)
        if held is not None:
            self.engine.release(held[0])
        precopy.forget(self, rid)
        if self.receiver:
            self.receiver.abort(rid)

    def tick(self):
        now = time.monotonic()
        for rid, (table, deadline) in list(self.held.items()):
            if deadline < now and rid not in self.waiting:
                del self.held[rid]
                self.engine.release(table)
                precopy.forget(self, rid)
        for rid, (_, deadline) in list(self.waiting.items()):
            if deadline < now:
                msg = self.waiting.pop(rid)[0]
                self.receiver.abort(rid)
                if GroupReceive.sliced(msg, self.engine):
                    self.group_kv.abort(rid, GroupReceive.split(msg, self.engine) or {"kv_tp": 1})
                self.fail(rid, 502, f"KV for {rid} did not arrive within {self.kv_timeout:.0f}s", stage="kv_recv")
        self._admit_blocked()
        self.moves.tick()
        if not self.engine.has_work:
            return
        try:
            out = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self.after_step_error()
            for rid in list(self.live):
                self._finish(rid)
                self.fail(rid, 500, f"decode failed: {e}")
            return
        with self.batched():
            for seq in out.refused:
                self._finish(seq.rid)
                self.fail(seq.rid, 400,
                          f"the request needs more KV blocks than this worker has ({self.engine.num_blocks})")
            for tok in out.tokens:
                self._emit(tok)
            self.report_progress(out, getattr(getattr(self.engine, "scheduler", None), "waiting", ()))

    def _emit(self, tok):
        """One token out as what it is: ``first`` (prompt computed here), ``tokens`` or ``done``, with its ``index``."""
        seq = tok.seq
        live = self.live.get(seq.rid)
        if live is None:
            return
        if live.colocated and tok.first:
            now, scheduled = time.perf_counter(), seq.scheduled_at or live.started
            self.emit(seq.rid, "first", **first_message(tok, (now - scheduled) * 1e3, (scheduled - live.started) * 1e3),
                      **prompt_cache(seq))
            live.started = time.perf_counter()
            if tok.finish_reason:
                self._finish(seq.rid)
                self.completed += 1
                self.reply_to.pop(seq.rid, None)
            return
        if not tok.finish_reason:
            self.emit(seq.rid, "tokens", ids=[tok.token], text=tok.text, logprobs=tok.logprobs, index=tok.index)
            return
        self._finish(seq.rid)
        self.completed += 1
        decode_ms = (time.perf_counter() - live.started) * 1e3
        phases = live.phases if isinstance(live.phases, dict) or live.phases is None else live.phases.to_dict()
        self.emit(seq.rid, "done", ids=[tok.token], text=tok.text, finish_reason=tok.finish_reason,
                  completion_tokens=tok.index + 1, timing={"decode": decode_ms, **pp_timing(seq)}, phases=phases,
                  logprobs=tok.logprobs, index=tok.index, **(prompt_cache(seq) if live.colocated else {}))

    def close(self):
        self.moves.close()
        if self.receiver:
            self.receiver.close()
        if self.shared_pool is not None:
            self.shared_pool.close()
        super().close()
