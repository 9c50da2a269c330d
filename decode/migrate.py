"""A decoding sequence moved to another decode worker: the source's side (``router.migration`` runs the protocol).

``precopy {rid, kv_dest}`` (first, where the target takes one address): the KV of the sequence's full blocks is
copied out of the pool and sent to ``kv_dest`` as the transfer ``RID:pre`` while the sequence decodes on (full
blocks never change); then ``precopied {rid, tokens}`` to the router (tokens 0: none sent). ``migrate {rid,
kv_dest, kv_skip}``: the sequence leaves this worker's steps at once (the step in flight still hands out
its token, which goes to the router as usual). At the next tick where every token it has is known, its state is
sent to the router as ``paused {rid, resume}``: the prompt, the output tokens (the last one is the next step's
input), the detokenizer's position and the resolved sampling parameters (the seed's noise is a function of the
output count, penalties and ``min_tokens`` count the outputs, the grammar is replayed over them), and its KV, every
token but the last (after the ``kv_skip`` tokens sent ahead; at least one token goes), goes to ``kv_dest`` over this
worker's transport, in a thread. The target continues from the
token after this worker's last, so the client sees neither a token twice nor a gap. Where the KV is split (a
tensor-parallel group or a pipeline here, or a pipeline there: ``kv_dest`` its ``{"stages": ...}``) every rank or
stage sends its part from its own pool (``kv_push`` on the plan) and ``resume`` says how (``kv_tp``, ``kv_pp``);
an MLX engine sets the sequence aside out of its batch and sends it whole.

Until the router says ``release`` (the target streamed its first token) the sequence keeps its blocks here; on
``unpause`` (the target failed) it goes back into this worker's steps and decodes on. A KV push that fails
unpauses it here and tells the router ``migrate_failed``; so does a ``migrate`` for a sequence that is not
decoding here (unknown, still prefilling, finished)."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtransfer import PiecewiseKV, SourceKV, TransferError, make_sender
from kvtransfer.convert import layout_for
from kvtransfer.phases import merge_ranks
from prefill.tp_kv import GroupPushes, kv_spans, push_slices, push_whole, stages_ok

from .tp_kv import PUSHED

log = logging.getLogger(__name__)
OPS = ("precopy", "migrate", "release", "unpause", "_moved")


def _is_dest(dest) -> bool:
    """A decode worker's KV address, a tensor-parallel group's (one per rank), or a pipeline's stages
    (``{"stages": [[first, end, address], ...]}``)."""
    if isinstance(dest, dict):
        return stages_ok(dest.get("stages"))
    return isinstance(dest, str) or (isinstance(dest, list) and bool(dest) and all(isinstance(d, str) for d in dest))


def _copied_event(kv: list):
    """An event after the copy of ``kv`` out of the pool on a CUDA device (None elsewhere): the sender thread waits
    for it, so no stream of a transport reads the copy before the engine's stream wrote it."""
    first = kv[0][0] if kv else None
    if first is None or first.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first.device))
    return event


class Moves:
    def __init__(self, worker, transport: str, cfg):
        self.worker, self.transport, self.cfg = worker, transport, cfg
        self.sender = None
        self.stream = None  # (CUDA) the stream a pause copies the KV out on, made at the first
        self.group_pushes = None  # a tensor-parallel group's: its followers' parts of a push (made at the first)
        self.threads = ThreadPoolExecutor(1, thread_name_prefix="kv-move")
        self.asked: dict[str, tuple] = {}  # rid -> (kv_dest: an address, or one per rank of a group; tokens sent
        # ahead), out of the steps, waiting for its tokens to be known
        self.paused: dict[str, object] = {}  # rid -> sequence, its KV sent or on its way
        self.moved_out = 0
        self.sent_ahead = 0  # tokens whose KV went ahead of a pause (precopy)
        self.closed = threading.Event()
        self.hold = os.environ.get("PDSERVE_TEST_HOLD_MOVES") == "1"  # a test hook: pushes wait for the worker's end

    @property
    def engine(self):
        return self.worker.engine

    def handle(self, msg: dict) -> None:
        op, rid = msg["op"], msg["rid"]
        if op == "precopy":
            self._precopy(rid, msg.get("kv_dest"))
        elif op == "migrate":
            self._ask(rid, msg.get("kv_dest"), int(msg.get("kv_skip") or 0))
        elif op == "release":
            if self.paused.pop(rid, None) is not None:
                self.moved_out += 1
            self.worker.forget(rid)  # its blocks back; nothing more goes to the router for it
        elif op == "unpause" and not self._unpause(rid) and rid not in self.worker.live:
            self.worker.reply_to.pop(rid, None)  # aborted meanwhile: this message made the address up again
        elif op == "_moved" and not msg["ok"]:
            if self._unpause(rid):
                self.worker.emit(rid, "migrate_failed", message=msg["message"])

    def _movable(self, rid: str, kv_dest):
        """The sequence ``rid`` where it can move, else None (``migrate_failed`` sent)."""
        live = self.worker.live.get(rid)
        seq = live.seq if live is not None else None
        why = ("no KV address to send to" if not _is_dest(kv_dest) else
               "not decoding here" if seq is None or seq.finished or not seq.output_ids else
               "moving already" if rid in self.asked or rid in self.paused else
               "an MLX engine sends its KV whole, and the target is a pipeline" if isinstance(kv_dest, dict)
               and not self.paged else
               "this worker has no KV transport (colocated)" if self.transport is None else None)
        if why is None:
            return seq
        self.worker.emit(rid, "migrate_failed", message=why)
        if seq is None or seq.finished:
            self.worker.reply_to.pop(rid, None)
        return None

    def _ask(self, rid: str, kv_dest, skip: int) -> None:
        seq = self._movable(rid, kv_dest)
        if seq is not None:
            self.engine.set_aside(seq)
            self.asked[rid] = (kv_dest, skip)

    def _precopy(self, rid: str, kv_dest) -> None:
        """(Engine thread) The full blocks' KV out of the pool now, sent ahead in the sender thread."""
        seq = self._movable(rid, kv_dest)
        if seq is None:
            return
        tokens = seq.num_computed // self.engine.block_size * self.engine.block_size  # full blocks, written
        if not isinstance(kv_dest, str) or tokens == 0 or self._in_pieces(kv_dest) or not self.paged:
            return self.worker.emit(rid, "precopied", tokens=0)  # (a group's ranks or a pipeline's stages each
        try:  # hold their part, an MLX engine's batch every row: all of it goes at the pause)
            layout, kv, copied = self._copy_out(seq, 0, tokens, kv_dest)
        except Exception as e:  # noqa: BLE001 - the move goes on without it
            log.warning("copying the KV of %s out of the pool to send it ahead failed: %s", rid, e)
            return self.worker.emit(rid, "precopied", tokens=0)
        self.threads.submit(self._push_ahead, rid, kv_dest, layout, kv, copied)

    @property
    def paged(self) -> bool:
        return getattr(self.engine, "paged", True)

    def _in_pieces(self, kv_dest) -> bool:
        """Whether every rank or stage here sends its part of the KV from its own pool (a group or a pipeline here,
        or a pipeline there, which takes layer ranges), rather than this process all of it."""
        return self.paged and (self.engine.group.size > 1 or getattr(self.engine, "stage", None) is not None
                               or isinstance(kv_dest, dict))

    def _beside_steps(self):
        """A pause's copy out on a CUDA stream of its own: the paused sequence's KV was all written by steps whose
        tokens are known (done on the device), so its copy need not queue behind the step in flight on the
        engine's stream (which holds other sequences only). Elsewhere the copy stays where it is."""
        device = getattr(self.engine, "device", None)
        if not self.paged or device is None or torch.device(device).type != "cuda":
            return contextlib.nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return torch.cuda.stream(self.stream)

    def _copy_out(self, seq, skip: int, tokens: int, kv_dest) -> tuple:
        """``(layout, KV, copied event)`` of tokens ``[skip, tokens)`` of ``seq``: into the sender's own memory
        where it has room, else a piece a layer where it sends pieces, else pool copies (an MLX engine's: arrays
        of its own)."""
        layout = layout_for(self.engine.kv_shape, tokens - skip, self.engine.kv_dtype, self.engine.kv_scales)
        if self.sender is None:
            self.sender = make_sender(self.transport, self.cfg)
        if not self.paged:
            return layout, self.engine.kv_out(seq, skip, tokens), None
        whole = not isinstance(kv_dest, list)  # (a group's ranks each get a copy of their heads)
        source = self.sender.alloc(layout, str(self.engine.device)) if whole else None  # sent from as it is
        try:
            kv = self.engine.kv_out(seq, skip, tokens, source.layers if source is not None else None)
        except Exception:
            if source is not None:
                source.release()
            raise
        copied = _copied_event(kv)
        if source is not None:
            return layout, source, copied
        if whole and getattr(self.sender, "sends_pieces", False):  # no room in its memory:
            kv = PiecewiseKV(layout, [([k], [v]) for k, v in kv])  # a piece a layer, joined there in one copy
        return layout, kv, copied

    def _push_ahead(self, rid: str, kv_dest: str, layout, kv, copied) -> None:
        """(Sender thread) The full blocks to the target as ``RID:pre``; ``precopied`` either way."""
        try:
            if copied is not None:
                copied.synchronize()
            phases = self.sender.send(kv_dest, rid + ":pre", layout, kv, {})
        except Exception as e:  # noqa: BLE001 - the move goes on, sending everything at the pause
            log.warning("sending the KV of %s ahead to %s failed: %s", rid, kv_dest, e)
            return self.worker.emit(rid, "precopied", tokens=0)
        finally:
            if isinstance(kv, SourceKV):
                kv.release()
        self.sent_ahead += layout.num_tokens
        self.worker.emit(rid, "precopied", tokens=layout.num_tokens, phases=phases.to_dict())

    def tick(self) -> None:
        """(Engine thread, before a step) Pause the asked sequences whose tokens are all known, and push their KV."""
        for rid, (kv_dest, skip) in list(self.asked.items()):
            live = self.worker.live.get(rid)
            if live is None or live.seq.finished:  # ended by its last token in flight: its done went out
                del self.asked[rid]
                continue
            seq = live.seq
            if seq.pending or self.engine.holds_token(seq):  # a token not yet handed out (in a pipeline's flight)
                continue
            del self.asked[rid]
            self._pause(rid, live, kv_dest, skip)

    def _pause(self, rid: str, live, kv_dest: str, skip: int) -> None:
        seq = live.seq
        tokens = seq.num_tokens - 1
        bs = self.engine.block_size
        skip = max(0, min(skip, (tokens - 1) // bs * bs))  # whole blocks sent ahead; at least one token goes now
        if self._in_pieces(kv_dest):  # (an MLX group's rank 0 gathers every head)
            return self._pause_group(rid, live, kv_dest, tokens)
        start = time.perf_counter()
        try:
            with self._beside_steps():
                layout, kv, copied = self._copy_out(seq, skip, tokens, kv_dest)
        except Exception as e:  # noqa: BLE001 - the sequence decodes on here
            log.exception("copying the KV of %s out of the pool failed", rid)
            self.engine.take_back(seq)
            return self.worker.emit(rid, "migrate_failed", message=f"KV copy failed: {e}")
        d2h_ms = (time.perf_counter() - start) * 1e3
        log.info("paused %s to move it (%d tokens of KV copied out in %.1f ms, %d sent ahead)", rid, tokens - skip,
                 d2h_ms, skip)
        self.paused[rid] = seq
        resume = self._resume_state(seq, skip)
        handoff = live.phases if isinstance(live.phases, dict) or live.phases is None else live.phases.to_dict()
        self.worker.emit(rid, "paused", resume=resume, kv_tokens=tokens - skip, kv_bytes=layout.total_nbytes,
                         phases=handoff)  # its own KV's arrival here, which its done would have reported
        self.threads.submit(self._push, rid, kv_dest, layout, kv, d2h_ms, copied)

    def _resume_state(self, seq, skip: int, dests: list | None = None) -> dict:
        """What the target needs to go on; ``dests`` where the KV goes in pieces: how they are split (``kv_tp``:
        by this group's heads, ``kv_pp``: by this pipeline's stages, or by layer for a pipeline there)."""
        split = {"kv_tp": self.engine.group.size if self.paged else 1}
        if dests is not None:
            split.update(kv_spans(self.engine, dests[0]))
        return {"prompt_ids": seq.prompt_ids, "earlier": seq.output_ids[:-1], "first_token": seq.output_ids[-1],
                "emitted": seq.detok.emitted, "params": seq.params.to_dict(), "kv_skip": skip, **split}

    def _pause_group(self, rid: str, live, kv_dest, tokens: int) -> None:
        """A pause whose KV goes in pieces: every rank (every stage) sends its heads (its layers) straight from its
        pool, to each rank (each stage) of the target its part (``kv_push`` on the plan now, from the engine thread,
        which owns the plan; the pushes in the sender thread)."""
        seq = live.seq
        if self.sender is None:
            self.sender = make_sender(self.transport, self.cfg)
        if self.group_pushes is None:
            self.group_pushes = GroupPushes(self.engine, kind=PUSHED)
        dests = kv_dest if isinstance(kv_dest, list) else [kv_dest]
        self.group_pushes.start(rid, dests, seq.block_table, tokens, False)
        self.paused[rid] = seq
        layout = layout_for(self.engine.model_kv_shape, tokens, self.engine.kv_dtype, self.engine.kv_scales)
        handoff = live.phases if isinstance(live.phases, dict) or live.phases is None else live.phases.to_dict()
        self.worker.emit(rid, "paused", resume=self._resume_state(seq, 0, dests), kv_tokens=tokens,
                         kv_bytes=layout.total_nbytes, phases=handoff)
        self.threads.submit(self._push_group, rid, dests, list(seq.block_table), tokens)

    def _push_group(self, rid: str, dests: list, table: list, tokens: int) -> None:
        """(Sender thread) Rank 0's heads, then the followers' reports; ``moved``, or back to the engine thread."""
        if self.hold:
            self.closed.wait()
            return
        timeout = self.cfg.timeout_s
        try:
            own = push_slices(self.engine, self.sender, rid, dests, table, tokens, None, timeout)
            reports = self.group_pushes.wait(rid, timeout)
        except Exception as e:  # noqa: BLE001 - whatever stops a push leaves the sequence on this group
            log.warning("moving the KV of %s to %s failed: %s", rid, dests, e)
            self.group_pushes.discard(rid, timeout)
            self.worker.inbox.put({"op": "_moved", "rid": rid, "ok": False, "message": f"KV transfer failed: {e}"})
            return
        self.worker.emit(rid, "moved", phases=merge_ranks(own, reports).to_dict())

    def _push(self, rid: str, kv_dest: str, layout, kv, d2h_ms: float, copied=None) -> None:
        """(Sender thread) The KV to the target; ``moved`` with its phases, or back to the engine thread. Little
        Python runs here: the engine thread, which holds the GIL most of the time, copied the KV out already (into
        the sender's own memory where it has some), so a busy engine does not stretch each small step of a push."""
        start = time.perf_counter()
        if self.hold:  # (a test loses the source mid-move)
            self.closed.wait()
            return
        try:
            if copied is not None:  # the copy ran on the engine's stream; a transport may read on a stream of its own
                copied.synchronize()
            meta = {"d2h_ms": d2h_ms}
            if isinstance(kv_dest, list):  # a tensor-parallel group: each rank its heads
                phases = push_whole(self.sender, rid, kv_dest, layout, kv, meta)
            else:
                phases = self.sender.send(kv_dest, rid, layout, kv, meta)
        except Exception as e:  # noqa: BLE001 - whatever stops a push leaves the sequence on this worker
            if not isinstance(e, (TransferError, OSError, TimeoutError)):
                log.exception("moving the KV of %s to %s failed", rid, kv_dest)
            log.warning("moving the KV of %s to %s failed: %s", rid, kv_dest, e)
            self.worker.inbox.put({"op": "_moved", "rid": rid, "ok": False, "message": f"KV transfer failed: {e}"})
            return
        finally:
            if isinstance(kv, SourceKV):
                kv.release()
        log.info("moved the KV of %s (%d tokens) to %s in %.1f ms", rid, layout.num_tokens, kv_dest,
                 (time.perf_counter() - start) * 1e3)
        self.worker.emit(rid, "moved", phases=phases.to_dict())

    def _unpause(self, rid: str) -> bool:
        seq = self.paused.pop(rid, None)
        if seq is None or seq.freed:
            return False
        self.engine.take_back(seq)
        return True

    def drop(self, rid: str) -> None:
        """``rid`` was aborted (its blocks go with the worker's own bookkeeping)."""
        self.asked.pop(rid, None)
        self.paused.pop(rid, None)

    def info(self) -> dict:
        return {"migrations_out": self.moved_out, "migrations_sent_ahead_tokens": self.sent_ahead,
                "migrations_pausing": len(self.asked) + len(self.paused),
                "migrations_paused": len(self.paused)}

    def close(self) -> None:
        self.closed.set()
        self.threads.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
