"""KV pushes of a tensor-parallel prefill group: every rank sends its own KV heads, straight from its pool.

Protocol (on the step plan, ``engine.parallel.plan``): rank 0 sends
``kv_push{rid, dests, table, tokens, stream}`` — before the step whose forward
computes the prompt's last chunk when the push streams layer by layer, after
it otherwise. ``dests`` are the decode group's KV addresses, one per rank.
Each rank sends the slices ``heads.send_pieces`` gives it, each as its own
transfer (``heads.piece_id``): a slice that is all of a rank's heads goes
from the pool blocks as they are (``PiecewiseKV``, streamed layer by layer);
a part of them (the groups differ in size) is gathered out of the blocks
once the forward ended, since a head range of a token's row is not contiguous.
Followers answer ``report{rid, rank, ok, phases | error}``; rank 0 waits for
all before ``kv_sent`` and before the blocks are freed (``GroupPushes``).
``kv_cancel{rid}`` stops a push in flight."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from engine.parallel.heads import kv_range, piece_id, recv_pieces, send_pieces
from engine.pipeline.split import layer_pieces
from engine.progress import LayerProgress, ShiftedGate, StepFailed
from kvtransfer import KVLayout, PiecewiseKV, PoolRows, TransferError, make_sender
from kvtransfer import spec as transport_spec
from kvtransfer.phases import PHASES, PhaseTimes, merge_ranks
from kvtransfer.convert import layout_for

log = logging.getLogger(__name__)


def kv_spans(engine, dest) -> dict:
    """``{"kv_pp": [[first, end], ...]}``: the layers each stage of this pipeline sends (``[[0, layers]]`` from a
    worker without stages that sends by layer range, to a pipeline; nothing otherwise), for the ``first`` message, so the decode worker knows
    which pieces to wait for."""
    stages = getattr(getattr(engine, "stage", None), "stages", None)
    if stages is not None:
        return {"kv_pp": [list(s) for s in stages.spans]}
    return {"kv_pp": [[0, engine.model_kv_shape[0]]]} if isinstance(dest, dict) else {}


def stages_ok(stages) -> bool:
    """A pipeline's ``kv_stages`` as it reports them: ``[[first, end, address], ...]``."""
    return isinstance(stages, list) and bool(stages) and all(
        isinstance(s, list) and len(s) == 3 and type(s[0]) is int and type(s[1]) is int and isinstance(s[2], str)
        for s in stages)


def layer_dest(msg: dict, engine):
    """Where a prompt's KV goes: the ``kv_dest`` of the message, or, when the decode worker is a pipeline
    (``kv_stages``) and this worker can send by layer range (a paged pool), ``{"stages": kv_stages}``."""
    stages = msg.get("kv_stages")
    return {"stages": stages} if stages_ok(stages) and getattr(engine, "paged", True) else msg.get("kv_dest")


def targets(engine, dests: list) -> tuple[list, bool]:
    """``([(layers [first, end), rank, ranks, address)], by layer)``: the decode side as this rank sees it (a
    pipeline's stages, each one rank; or a group's ranks, each every layer), and whether pieces go by layer range
    (either side is a pipeline)."""
    if isinstance(dests[0], dict):
        return [((first, end), 0, 1, address) for first, end, address in dests[0]["stages"]], True
    layers = engine.model_kv_shape[0]
    return [((0, layers), j, len(dests), d) for j, d in enumerate(dests)], getattr(engine, "stage", None) is not None


def push_slices(engine, sender, rid: str, dests: list, table: list, tokens: int, progress=None,
                timeout_s: float = 60.0) -> PhaseTimes:
    """Send this rank's pieces of the KV in ``table`` to the decode side at ``dests``: the heads each decode rank
    holds (``heads.send_pieces``) of the layers each holds (``split.layer_pieces``), each piece a transfer of its
    own, from the pool blocks as they are when it is all of this rank's heads; phases summed over them."""
    spec, group = engine.model.spec, engine.group
    heads, span = spec.num_kv_heads, engine.model.span
    own = kv_range(heads, group.size, group.rank)[0]
    decode, layered = targets(engine, dests)
    total, pieces = PhaseTimes(), None
    for (first, end), j, ranks, address in decode:
        n = len(recv_pieces(heads, group.size, ranks, j))
        for dst, lo, hi in send_pieces(heads, group.size, group.rank, ranks):
            for l0, l1 in (layer_pieces([span], (first, end)) if layered else [span]) if dst == j else ():
                tid = piece_id(rid, lo, n) + (f":L{l0}" if layered else "")
                a, b = l0 - span[0], l1 - span[0]
                layout = layout_for((l1 - l0, hi - lo, spec.head_dim), tokens, engine.kv_dtype,
                                    engine.kv_scales[a:b] if engine.kv_scales else None)  # FP8: these layers' scales
                if (lo - own, hi - own) == (0, engine.heads.kv_heads) and sender.takes_pieces(engine.device):
                    pieces = pieces or PoolRows(*engine.rows(table, tokens))
                    kv = PiecewiseKV(layout, pieces[a:b], gate=ShiftedGate(progress, a) if progress else None)
                else:
                    if progress is not None:
                        progress.wait_computed(timeout_s)
                    began = time.perf_counter()
                    kv = engine.pool.gather(table, tokens, heads=(lo - own, hi - own))[a:b]
                    total.d2h += (time.perf_counter() - began) * 1e3
                phases = sender.send(address, tid, layout, kv)
                for name in (*PHASES, "bytes"):
                    setattr(total, name, getattr(total, name) + getattr(phases, name))
    return total


def push_whole(sender, rid: str, dests: list, layout: KVLayout, layers, meta=None) -> PhaseTimes:
    """KV of all heads held in one place (the mlx engine's rank 0 gathers them) to a decode group: each rank its
    slice (a copy of the head range), as one prefill rank of a group of one would send it."""
    heads, total = layout.num_kv_heads, PhaseTimes()
    for dst, lo, hi in send_pieces(heads, 1, 0, len(dests)):
        part = dataclasses.replace(layout, num_kv_heads=hi - lo)
        kv = layers if (lo, hi) == (0, heads) else [tuple(_heads_of(t, lo, hi) for t in kv) for kv in layers]
        phases = sender.send(dests[dst], piece_id(rid, lo, len(recv_pieces(heads, 1, len(dests), dst))), part, kv,
                             meta)
        for name in (*PHASES, "bytes"):
            setattr(total, name, getattr(total, name) + getattr(phases, name))
    return total


def _heads_of(t, lo: int, hi: int):
    """Heads ``[lo, hi)`` of a canonical ``[tokens, heads, dim]`` layer, contiguous (torch or MLX)."""
    if hasattr(t, "contiguous"):
        return t[:, lo:hi].contiguous()
    import mlx.core as mx

    part = mx.contiguous(t[:, lo:hi])
    mx.eval(part)
    return part


def cancel_slices(sender, rid: str, heads: int, span: tuple = (0, 0)) -> None:
    """Stop every transfer of ``rid``: the whole KV, each slice (a model of ``heads`` KV heads), each of those by
    layer range from the layers ``span``."""
    for base in [rid] + [piece_id(rid, lo, 2) for lo in range(heads)]:
        sender.cancel(base)
        for first in range(*span):
            sender.cancel(f"{base}:L{first}")


STUCK_AFTER = 2  # pushes in a row on which one follower never reported: it is stuck in a transfer


class GroupPushes:
    """Rank 0's side: plan each push, collect the followers' reports. A follower that sends no report at all for
    ``STUCK_AFTER`` pushes in a row (its sender thread blocked: an NCCL group whose other end failed while forming
    it never returns) is taken as stuck: ``on_stuck(rank)`` (the worker fails its requests and exits, and ``pdserve
    up`` restarts the group) rather than every later push waiting out its timeout behind it."""

    def __init__(self, engine, on_stuck=None, kind: str | None = None):
        """``kind``: the followers' reports carry it (a decode group's plan has reports of other kinds too)."""
        self.on_stuck, self.silent = on_stuck, {}  # rank -> pushes in a row it did not report on
        self.plan, self.followers = engine.group.plan, engine.group.size - 1
        stages = getattr(getattr(engine, "stage", None), "stages", None)
        if stages is not None:  # a pipeline: every stage pushes its layers
            self.plan, self.followers = stages.plan, len(stages.spans) - 1
        self.reports: dict[str, list] = {}
        self._cond = threading.Condition()
        if self.plan is not None and kind is not None:
            self.plan.by_kind[kind] = self._on_report
        elif self.plan is not None:
            self.plan.on_report = self._on_report

    def start(self, rid: str, dests: list, table: list, tokens: int, stream: bool) -> None:
        if self.plan is not None:
            with self._cond:
                self.reports[rid] = []
            self.plan.send("kv_push", rid=rid, dests=dests, table=list(table), tokens=tokens, stream=stream)

    def cancel(self, rid: str) -> None:
        if self.plan is not None:
            self.plan.send("kv_cancel", rid=rid)

    def _on_report(self, msg: dict) -> None:
        with self._cond:
            if msg.get("rid") in self.reports:
                self.reports[msg["rid"]].append(msg)
                self._cond.notify_all()

    def discard(self, rid: str, timeout_s: float) -> None:
        """After a failed push: stop the followers' part and wait (bounded) until they let go of the blocks."""
        self.cancel(rid)
        try:
            self.wait(rid, timeout_s)
        except TransferError:
            pass

    def wait(self, rid: str, timeout_s: float) -> list[dict]:
        """Every follower's report of ``rid``; raises TransferError when one failed or they took too long."""
        if self.plan is None:
            return []
        with self._cond:
            done = self._cond.wait_for(lambda: len(self.reports.get(rid, ())) >= self.followers, timeout_s)
            reports = self.reports.pop(rid, [])
        self._count_silent(reports)
        failed = [r for r in reports if not r.get("ok")]
        if failed:
            raise TransferError(f"rank {failed[0]['rank']}: {failed[0].get('error')}")
        if not done:
            raise TransferError(f"{self.followers - len(reports)} ranks did not report within {timeout_s:.0f}s")
        return reports

    def _count_silent(self, reports: list[dict]) -> None:
        heard = {r.get("rank") for r in reports}
        for rank in range(1, self.followers + 1):
            self.silent[rank] = 0 if rank in heard else self.silent.get(rank, 0) + 1
            if self.silent[rank] >= STUCK_AFTER and self.on_stuck is not None:
                self.on_stuck(rank)


def push_group(worker, rid, dests, table, layout, computed) -> None:
    """(A prefill worker's sender thread) This rank's slices, then the other ranks' reports: one ``kv_sent`` for
    the group; the blocks are freed (``_sent``) once all have sent."""
    sent = False
    progress = computed if isinstance(computed, LayerProgress) else None
    try:
        start = time.perf_counter()
        try:
            own = push_slices(worker.engine, worker.sender, rid, dests, table, layout.num_tokens, progress,
                              worker.cfg.timeout_s)
            reports = worker.group_pushes.wait(rid, worker.cfg.timeout_s)
        except (TransferError, StepFailed) as e:
            log.warning("KV push for %s failed: %s", rid, e)
            worker.group_pushes.discard(rid, worker.cfg.timeout_s)
            return worker.fail(rid, 502, f"KV transfer to decode failed: {e}", stage="kv_send")
        end = time.perf_counter()
        done = progress.wait_computed(worker.cfg.timeout_s) if progress is not None else computed
        stream = {"streamed": progress is not None, "overlap": max(0.0, min(done, end) - start) * 1e3,
                  "exposed": max(0.0, end - max(done, start)) * 1e3}
        worker.emit(rid, "kv_sent", phases=merge_ranks(own, reports), stream=stream)
        sent = True
    except StepFailed as e:
        worker.fail(rid, 502, f"prefill failed during the KV push: {e}", stage="kv_send")
    finally:
        worker.inbox.put({"op": "_sent", "rid": rid, "ok": sent})
        worker._count("held_bytes", -layout.total_nbytes)
        worker._count("pushing", -1)


class PrefillRankKV:
    """A follower rank's side: its own sender, pushes run on a thread pool, reports to rank 0 (``kind`` in each
    where given)."""

    def __init__(self, engine, plan, kind: str | None = None):
        name, self.cfg = transport_spec.load(os.environ[transport_spec.ENV])
        if name == "nccl":  # this rank's GPU, not rank 0's
            self.cfg.options["device"] = str(engine.device)
        self.engine, self.plan, self.kind = engine, plan, {"kind": kind} if kind else {}
        self.sender = make_sender(name, self.cfg)
        self.threads = ThreadPoolExecutor(4, thread_name_prefix="kv-send")
        self.pending: LayerProgress | None = None

    def take_progress(self):
        progress, self.pending = self.pending, None
        return progress

    def handle(self, msg: dict) -> None:
        if msg["op"] == "kv_cancel":
            return cancel_slices(self.sender, msg["rid"], self.engine.model_kv_shape[1], self.engine.model.span)
        progress = None
        if msg.get("stream"):  # every push that streams from the coming step shares its progress
            progress = self.pending = self.pending or LayerProgress(self.engine.kv_shape[0], self.engine.device)
        self.threads.submit(self._push, msg, progress)

    def _push(self, msg: dict, progress) -> None:
        rank = getattr(self.engine.stage, "stage", None) or self.engine.group.rank  # a pipeline's stage number
        try:
            phases = push_slices(self.engine, self.sender, msg["rid"], msg["dests"], msg["table"], msg["tokens"],
                                 progress, self.cfg.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure ends the push with an error report
            log.warning("rank %d: KV push of %s failed: %s", rank, msg["rid"], e)
            self.plan.report(rid=msg["rid"], rank=rank, ok=False, error=str(e), **self.kind)
            return
        self.plan.report(rid=msg["rid"], rank=rank, ok=True, phases=phases.to_dict(), **self.kind)
