"""Prefill worker process.

Each ``prefill`` request becomes a sequence in the engine, which batches
queued prompts into one forward pass up to its token budget (longer prompts
go in chunks). When a sequence's first token is chosen the worker sends
``first`` (token + text, and how many prompt tokens came from its prefix
cache: ``prefill.cached``) to the router at once and pushes the prompt's KV
to the decode worker at ``kv_dest`` in a sender thread: transports that
send pieces (tcp, shm and nixl, whose agent registers the pool once, from a
pool in host memory; nccl from one on its GPU) move it straight from the
engine's pool blocks, which are freed once the push ends; the others get it
copied out of the pool once (into memory the transport owns and sends from
without staging where it offers some: an MLX array) and the blocks are
freed at once. A failed push answers ``error``; a
successful one ``kv_sent`` with the sender-side phases.

Layer-wise streaming (``kv_stream``, on by default, for transports that send
from the blocks): a push starts when the engine schedules a prompt's last
chunk, before its forward runs; the sender moves each layer as soon as the
forward wrote it (``LayerProgress``), so the transfer hides behind the
compute of the later layers. ``kv_sent`` reports ``overlap`` (transfer time
before the prefill compute ended) and ``exposed`` (from the end of the
compute to the receiver's acknowledgement), in ms on this worker's clock.

Bounds: at most ``max_queue`` prompts wait (more are refused with 503 and
``retry_after``); KV waiting to be pushed is held at most ``lease_s`` (then
the request fails with 504 and the KV is dropped)."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from control.worker import WorkerLoop, fixed_world
from engine import EngineConfig, RequestError
from engine.factory import make_engine
from engine.guided.background import Background
from engine.progress import LayerProgress, StepFailed
from engine.step_profiler import attach as attach_profiler
from engine.requests import first_message, new_sequence
from kvtransfer import KVLayout, PiecewiseKV, PoolRows, TransferError, TransportConfig, make_sender
from kvtransfer import spec as transport_spec

from .cached import prompt_cache
from .pushes import kv_suffix, push_ended
from .tp_kv import GroupPushes, cancel_slices, kv_spans, layer_dest, push_group, push_whole

log = logging.getLogger(__name__)


class PrefillWorker(WorkerLoop):
    role = "prefill"

    def __init__(self, engine: EngineConfig, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 transport_cfg: TransportConfig | None = None, send_threads: int = 4, max_queue: int = 64,
                 drain_s: float = 20.0, kv_stream: bool = True):
        fixed_world(transport, engine)
        self.cfg = transport_cfg or TransportConfig(host=host)
        super().__init__(host, port, drain_s, self.cfg.token)
        self.pool_memory = None
        self.engine = make_engine(engine, hold_after_first=True,
                                  pool_memory=self._pool_memory if transport == "nixl" else None,
                                  tp_kv=("prefill.tp_kv:PrefillRankKV",
                                         {transport_spec.ENV: transport_spec.dump(transport, self.cfg)}))
        self.watch_group(self.engine)
        attach_profiler(self.engine, self.role)
        getattr(self.engine, "warm_up", lambda: None)()  # before on_schedule is set and before ready
        self.group_pushes = GroupPushes(self.engine, on_stuck=self._rank_stuck)
        self.paged = getattr(self.engine, "paged", True)
        self.engine.on_schedule = self._scheduled
        self.prefix_blocks = self.engine.blocks if self.engine.blocks.caching else None
        self.kv_skipped_bytes = 0
        self.live: dict = {}
        self.sending: dict = {}
        self.kv_from_blocks = 0
        self.transport = transport
        if transport == "nccl":  # the transport's GPU is the engine's
            self.cfg.options.setdefault("device", str(self.engine.device))
        self.sender = make_sender(transport, self.cfg)
        self.kv_stream = kv_stream and self.paged and self.sender.streams_layers and \
            self.sender.takes_pieces(self.engine.device)
        self.progress: LayerProgress | None = None
        self.streamed = 0
        if self.pool_memory is not None:
            self.sender.share(self.pool_memory)
        self.max_queue = max_queue
        self.queued = 0
        self.pushing = 0
        self.held_bytes = 0
        self.kv_in_place = 0
        self._count_lock = threading.Lock()
        self.senders = ThreadPoolExecutor(send_threads, thread_name_prefix="kv-send")
        self.aborted: set[str] = set()
        self.received_at: dict[str, float] = {}
        self.grammars = Background(self.engine, self.inbox.put, lambda rid: True)  # an abort meanwhile: see handle

    def _pool_memory(self, nbytes: int, device):
        """The KV pool in host memory the sender registers once (nixl), so it sends from the blocks."""
        if device.type != "cpu":
            return None
        self.pool_memory = torch.zeros(nbytes, dtype=torch.uint8)
        return self.pool_memory

    def info(self):
        return {"role": self.role, "model": self.engine.name, "engine": getattr(self.engine, "kind", "torch"),
                "device": str(getattr(self.engine, "device", "") or ""),
                "transport": self.transport, "max_len": self.engine.max_len,
                "kv_registrations": getattr(self.sender, "registrations", 0), "queued": self.queued,
                "pushing": self.pushing, "kv_held_bytes": self.held_bytes, "kv_in_place": self.kv_in_place,
                "kv_from_blocks": self.kv_from_blocks, "kv_streamed": self.streamed,
                "kv_staged_bytes": self.sender.staged_bytes,
                "kv_gathered_bytes": getattr(self.sender, "gathered_bytes", 0), "kv_blocks": self.engine.num_blocks,
                "kv_blocks_free": self.engine.blocks.num_free,
                "kv_geometry": list(self.engine.model_kv_shape), "prefilling": len(self.live),
                "kv_dtype": str(self.engine.kv_dtype).removeprefix("torch."),
                "kv_skipped_bytes": self.kv_skipped_bytes,
                "kv_pairs_aborted": getattr(getattr(self.sender, "pairs", None), "aborted", 0),
                **getattr(self.engine, "step_info", dict)(), **self.engine.prefix_info()}

    def busy(self):
        return bool(self.live)

    def idle(self):
        return super().idle() and self.pushing == 0 and not self.sending

    def _count(self, name, delta):
        with self._count_lock:
            setattr(self, name, getattr(self, name) + delta)

    def _on_message(self, identity, msg):
        op, rid = msg.get("op"), msg.get("rid")
        if op == "prefill" and isinstance(rid, str):
            if self.queued >= self.max_queue:
                self.server.send(identity, "error", rid=rid, status=503, retry_after=1,
                                 message=f"prefill queue full ({self.max_queue} waiting)")
                return
            self._count("queued", 1)
            self.received_at[rid] = time.perf_counter()
        super()._on_message(identity, msg)

    def on_abort(self, rid):
        self.aborted.add(rid)
        # a push to a decode worker that is gone or cut off would wait out its timeout (the mlx engine's model
        # has no spec: model_kv_shape holds the KV heads for both engines)
        sliced = self.engine.group.size > 1 or rid in self.sending
        cancel_slices(self.sender, rid, self.engine.model_kv_shape[1] if sliced else 0,
                      self.engine.model.span if self.paged else (0, 0))
        if self.paged and (self.engine.group.size > 1 or getattr(self.engine, "stage", None) is not None):
            self.group_pushes.cancel(rid)

    def handle(self, msg):
        rid = msg["rid"]
        if msg["op"] == "_sent":
            return push_ended(self, msg)
        if msg["op"] == "abort":
            live = self.live.pop(rid, None)
            if live is not None:
                self.aborted.discard(rid)
                if rid not in self.sending:  # a streaming push frees the blocks when it ends
                    self.engine.free(live[0])
                self._unqueue(live)
                self.reply_to.pop(rid, None)
            elif rid not in self.reply_to:
                self.aborted.discard(rid)
            return
        if msg["op"] == "prefill" and not self.grammars.ready(msg):
            return  # back once its grammar is compiled (engine.guided.background)
        queued_at = self.received_at.pop(rid, time.perf_counter())
        if msg["op"] != "prefill":
            return self.fail(rid, 400, f"prefill worker does not handle {msg['op']!r}")
        if rid in self.aborted:
            self.aborted.discard(rid)
            self.reply_to.pop(rid, None)
            self._count("queued", -1)
            return
        try:
            seq = new_sequence(self.engine, rid, msg)
        except RequestError as e:
            self._count("queued", -1)
            return self.fail(rid, e.status, str(e))
        self.engine.add(seq)
        skip = msg.get("kv_skip")
        self.live[rid] = [seq, layer_dest(msg, self.engine), queued_at, True, skip if isinstance(skip, list) else []]

    def tick(self):
        if not self.engine.has_work:
            return
        try:
            out = self.engine.step()
        except Exception as e:
            log.exception("prefill step failed")
            self.after_step_error()
            if self.progress is not None:
                self.progress.fail(e)
            for rid, entry in list(self.live.items()):
                self._drop(rid, entry[0])
                self.fail(rid, 500, f"prefill failed: {e}")
            return
        finally:
            progress, self.progress = self.progress, None
        if progress is not None:
            progress.finish()
        for seq in out.refused:
            self._drop(seq.rid, seq)
            self.fail(seq.rid, 400, f"the prompt needs more KV blocks than this worker has ({self.engine.num_blocks})")
        for tok in out.tokens:
            entry = self.live.pop(tok.seq.rid, None)
            if entry is None:
                self.engine.free(tok.seq)
                continue
            self._first(tok, entry[1], entry[2], entry[4])
        self.report_progress(out, getattr(getattr(self.engine, "scheduler", None), "waiting", ()))

    def _scheduled(self, batch):
        """Before a step's forward: prompts whose last chunk it computes start streaming their KV now."""
        streams = []
        for i, seq in enumerate(batch.seqs):
            entry = self.live.get(seq.rid)
            if entry is not None:
                self._unqueue(entry)
                if self.kv_stream and batch.samples(i) and _is_dest(entry[1]) and seq.rid not in self.aborted:
                    streams.append((seq, entry[1], entry[4]))
        if not streams or (self.sender.one_at_a_time and self.pushing):
            return None  # one at a time: a stream would hold the transport for this whole forward
        self.progress = LayerProgress(self.engine.kv_shape[0], self.engine.device)
        for seq, dest, skip in streams:
            layout, table = self._suffix(seq, skip)
            if self._grouped(dest):
                self._start_group_push(seq, dest, layout, table, self.progress)
                continue
            kv = PiecewiseKV(layout, PoolRows(*self.engine.rows(table, layout.num_tokens)), gate=self.progress)
            self.streamed += 1
            self._start_push(seq, dest, layout, kv, self.progress)
        return self.progress

    def _start_push(self, seq, dest, layout, kv, progress):
        self.sending[seq.rid] = seq
        self.kv_from_blocks += 1
        self._count("pushing", 1)
        self._count("held_bytes", layout.total_nbytes)
        self.senders.submit(self._push, seq.rid, dest, layout, kv, time.monotonic(), None, progress)

    def _grouped(self, dest) -> bool:
        """Whether every rank sends its own head slices: either side is a tensor-parallel group (the mlx engine
        gathers all heads on rank 0 instead, ``push_whole``)."""
        return self.paged and (isinstance(dest, (list, dict)) or self.engine.group.size > 1
                               or getattr(self.engine, "stage", None) is not None)

    def _start_group_push(self, seq, dest, layout, table, computed):
        """Every rank pushes its heads (``tp_kv``); the blocks are freed once all have."""
        dests = dest if isinstance(dest, list) else [dest]  # (a pipeline's: [{"stages": ...}])
        self.sending[seq.rid] = seq
        self.kv_from_blocks += 1
        self._count("pushing", 1)
        self._count("held_bytes", layout.total_nbytes)
        self.group_pushes.start(seq.rid, dests, table, layout.num_tokens, isinstance(computed, LayerProgress))
        self.senders.submit(push_group, self, seq.rid, dests, table, layout, computed)

    def _unqueue(self, entry):
        """A prompt stops counting against ``max_queue`` once the engine schedules it (or it leaves)."""
        if entry[3]:
            entry[3] = False
            self._count("queued", -1)

    def _drop(self, rid, seq):
        entry = self.live.pop(rid, None)
        if entry is not None:
            self._unqueue(entry)
        self.engine.free(seq)

    def _first(self, tok, dest, queued_at, skip=()):
        seq = tok.seq
        rid, now = seq.rid, time.perf_counter()
        scheduled = seq.scheduled_at or queued_at
        self.emit(rid, "first", **first_message(tok, (now - scheduled) * 1e3, (scheduled - queued_at) * 1e3),
                  kv_tp=self.engine.group.size if self.paged else 1,  # the mlx engine sends whole heads
                  **kv_spans(self.engine, dest), **prompt_cache(seq))
        if rid in self.sending:  # streaming since the step began; the push frees the blocks when it ends
            if seq.finished:
                self.reply_to.pop(rid, None)
            return
        if seq.finished:
            self.engine.free(seq)
            self.reply_to.pop(rid, None)
            return
        if not _is_dest(dest):
            self.engine.free(seq)
            return self.fail(rid, 500, "prefill request has no kv_dest")
        layout, table = self._suffix(seq, skip)
        if self._grouped(dest):
            return self._start_group_push(seq, dest, layout, table, now)
        if self.paged and self.sender.takes_pieces(self.engine.device):
            kv = PiecewiseKV(layout, PoolRows(*self.engine.rows(table, layout.num_tokens)))
            return self._start_push(seq, dest, layout, kv, now)
        source = self.sender.alloc(layout, str(self.engine.device)) if self.paged else None
        meta = None
        try:
            if self.paged:
                kv = self.engine.pool.gather(table, layout.num_tokens, source.layers if source is not None else None)
            else:  # the MLX engine: MLX arrays (one copy out of its caches, evaluated), sent as they are or viewed
                start = time.perf_counter()
                kv = self.engine.gather_prompt(seq, len(seq.prompt_ids) - layout.num_tokens)
                meta = {"d2h_ms": (time.perf_counter() - start) * 1e3}  # decode adds it to the phases it reports
        except Exception as e:
            log.exception("copying the KV of %s out of the pool failed", rid)
            if source is not None:
                source.release()
            return self.fail(rid, 500, f"prefill failed: {e}")
        finally:
            self.engine.free(seq)
        if source is not None:
            self.kv_in_place += 1
            kv = source
        self._count("pushing", 1)
        self._count("held_bytes", layout.total_nbytes)
        self.senders.submit(self._push, rid, dest, layout, kv, time.monotonic(), source, now, meta)

    def _suffix(self, seq, skip: list) -> tuple[KVLayout, list[int]]:
        layout, table, skipped = kv_suffix(self.engine, seq, skip)
        self.kv_skipped_bytes += skipped * self.engine.block_size * self.engine.kv_bytes_per_token
        return layout, table

    def _push(self, rid, dest, layout, kv, created, source, computed, meta=None):
        """(Sender thread) ``computed``: when the prompt's compute ended (``perf_counter``), or the step's
        ``LayerProgress`` while it is still running."""
        sent = False
        try:
            if rid in self.aborted:
                self.aborted.discard(rid)
                self.reply_to.pop(rid, None)
                return
            if time.monotonic() - created > self.cfg.lease_s:
                return self.fail(rid, 504, f"KV lease of {self.cfg.lease_s:.0f}s expired before the transfer started")
            start = time.perf_counter()
            try:
                if isinstance(dest, list):  # whole heads here (the mlx engine) for a decode group: its slices
                    phases = push_whole(self.sender, rid, dest, layout, kv, meta)
                else:
                    phases = self.sender.send(dest, rid, layout, kv, meta)
            except (TransferError, StepFailed) as e:
                log.warning("KV push for %s failed: %s", rid, e)
                return self.fail(rid, 502, f"KV transfer to decode failed: {e}", stage="kv_send")
            end = time.perf_counter()
            if isinstance(computed, LayerProgress):
                try:
                    computed = computed.wait_computed(self.cfg.timeout_s)
                except StepFailed:
                    computed = end
            stream = {"streamed": kv.gate is not None if isinstance(kv, PiecewiseKV) else False,
                      "overlap": max(0.0, min(computed, end) - start) * 1e3,
                      "exposed": max(0.0, end - max(computed, start)) * 1e3}
            self.emit(rid, "kv_sent", phases=phases.to_dict(), stream=stream)
            sent = True
        finally:
            if source is not None:
                source.release()
            # the engine thread forgets the request: a streamed push can end before the first token is out
            self.inbox.put({"op": "_sent", "rid": rid, "ok": sent})
            self._count("held_bytes", -layout.total_nbytes)
            self._count("pushing", -1)

    def close(self):
        self.senders.shutdown(wait=False, cancel_futures=True)
        self.sender.close()
        super().close()


def _is_dest(dest) -> bool:
    """A decode worker's KV address, a decode group's (one per rank), or a pipeline's (``{"stages": ...}``)."""
    return isinstance(dest, str) or (isinstance(dest, list) and bool(dest) and all(isinstance(d, str) for d in dest)) \
        or isinstance(dest, dict)
