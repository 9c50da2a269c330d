"""KV arriving in pieces, into a group of ranks or stages: head slices from a tensor-parallel prefill group, layer
ranges from a pipelined prefill or into a pipelined decode worker.

Each decode rank (each stage of a pipeline) has its own receiver: ``kv_addr``
is the list of a group's (rank order); a pipeline names its stages'
``kv_stages`` (``[[first, end, address], ...]``), so a prefill worker sends
each stage the layers it holds. A rank receives the slices
``heads.recv_pieces`` names for it, each its own transfer
(``heads.piece_id``; a rank's whole heads in one piece keep the request id,
so a piece into a one-device worker from a one-device prefill is the plain
transfer); a stage receives the layers of its span from each prefill stage
(``split.layer_pieces``, ``rid:L<first>``). The ``decode`` message carries
the prefill's split: its group size (``kv_tp``) or its stages' layers
(``kv_pp``; ``[[0, layers]]`` from one process that sent by layer).

Rank 0 (``GroupReceive``), once its own pieces are in and the ``decode``
message is here: reserves the blocks (or takes the ones its whole piece
landed in), writes its pieces into them, and sends ``kv_adopt{rid, table,
kv_tp | kv_pp, timeout}`` on the plan. Each follower (``DecodeRankKV``)
waits for its pieces, writes them into the same blocks of its own pool,
releases them and reports ``{kind: adopted, rid, rank, ok, phases |
error}``; with every report in, rank 0 starts the sequence (the phases: the
slowest rank's, every rank's in ``ranks``). ``kv_abort{rid, kv_tp |
kv_pp}`` drops a request's pieces on every rank. Followers announce their
receiver with ``{kind: address, rank, address}`` when they start."""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from engine.parallel.heads import kv_range, piece_id, recv_pieces
from engine.pipeline.split import layer_pieces
from kvtransfer import TransferError, make_receiver
from kvtransfer import spec as transport_spec
from kvtransfer.phases import PhaseTimes
from kvtransfer.convert import convert, needs_convert
from kvtransfer.tensors import unpack

log = logging.getLogger(__name__)
PUSHED = "pushed"  # the kind of a follower's report on its part of a moved sequence's KV


def rank_of(engine) -> int:
    """This process's place in its worker: a pipeline stage's number, else its tensor-parallel rank."""
    return getattr(getattr(engine, "stage", None), "stage", None) or engine.group.rank


def own_pieces(rid: str, engine, split: dict) -> list[tuple[str, dict]]:
    """``(transfer id, where it goes in the pool)`` of each of this rank's pieces of ``rid``, for a prefill that
    split its KV as ``split`` (``kv_tp``: its group's size; ``kv_pp``: its stages' layers, when it sent by layer
    range): the heads this rank holds from each prefill rank, of the layers it holds from each prefill stage."""
    if getattr(engine, "paged", True):
        heads, size, rank = engine.model.spec.num_kv_heads, engine.group.size, engine.group.rank
        span = engine.model.span
    else:  # the mlx engine receives whole heads on rank 0
        heads, size, rank, span = engine.kv_shape[1], 1, 0, (0, engine.kv_shape[0])
    pieces = recv_pieces(heads, split.get("kv_tp", 1), size, rank)
    first = kv_range(heads, size, rank)[0]
    layers = layer_pieces(split["kv_pp"], span) if split.get("kv_pp") is not None else [None]
    out = []
    for lo, hi in pieces:
        for part in layers:
            place = {"heads": (lo - first, hi - first)}
            if part is not None:
                place["span"] = (part[0] - span[0], part[1] - span[0])
            out.append((piece_id(rid, lo, len(pieces)) + (f":L{part[0]}" if part else ""), place))
    return out


def piece_ids(rid: str, engine, split: dict) -> list[str]:
    return [tid for tid, _ in own_pieces(rid, engine, split)]


def collect(receiver, rid: str, engine, split: dict, timeout: float) -> list:
    """This rank's pieces of ``rid`` once all are in: ``(ReceivedKV, place)`` each (release them)."""
    out = []
    try:
        for tid, place in own_pieces(rid, engine, split):
            out.append((receiver.wait(tid, timeout), place))
    except BaseException:
        release(out)
        raise
    return out


def release(pieces: list) -> None:
    for received, _ in pieces:
        received.release()


def write(engine, pieces: list, table: list) -> PhaseTimes:
    """Write each piece into its heads or layers of ``table``'s blocks (one that landed there already is skipped)
    and release it; the phases summed over the pieces."""
    total = PhaseTimes()
    try:
        for received, place in pieces:
            if received.landed is None:
                if received.layers is not None:
                    views = received.layers
                else:
                    with received.phases.measure("deserialize"):
                        views = unpack(received.buffer, received.layout)
                pairs = engine.kv_scales[slice(*place["span"])] if engine.kv_scales and "span" in place else \
                    engine.kv_scales  # FP8: the scales of the layers this piece holds
                if needs_convert(received.layout, engine.kv_dtype, pairs):
                    with received.phases.measure("convert"):
                        views = convert(views, received.layout, engine.kv_dtype, pairs)
                with received.phases.measure("h2d"):
                    engine.pool.scatter(table, views, **place)
            for name, value in received.phases.to_dict().items():
                if name != "total":
                    setattr(total, name, getattr(total, name) + value)
    finally:
        release(pieces)
    return total


def split_in(msg: dict) -> dict:
    """How the prefill split the KV, as a ``decode``, ``kv_adopt`` or ``kv_abort`` message says (unchecked)."""
    return {"kv_tp": msg.get("kv_tp", 1), "kv_pp": msg.get("kv_pp")}


class DecodeRankKV:
    """A follower decode rank or pipeline stage: its own receiver; places its pieces when rank 0 says where."""

    def __init__(self, engine, plan):
        name, cfg = transport_spec.load(os.environ[transport_spec.ENV])
        cfg.port, cfg.host = 0, os.environ.get("PDSERVE_RAY_NODE_IP", cfg.host)  # a stage on another node: its own
        if name == "nccl":  # this rank's GPU, not rank 0's
            cfg.options["device"] = str(engine.device)
        self.engine, self.plan, self.timeout = engine, plan, cfg.timeout_s
        self.receiver = make_receiver(name, cfg)
        self.receiver.start()
        self.threads = ThreadPoolExecutor(4, thread_name_prefix="kv-place")
        self.pushes = None  # pushes of sequences moved off this group (decode.migrate), made at the first
        plan.report(kind="address", rank=rank_of(engine), address=self.receiver.address)

    def take_progress(self):
        return None

    def handle(self, msg: dict) -> None:
        if msg["op"] in ("kv_push", "kv_cancel"):  # a sequence moving off this group: this rank's heads of it
            if self.pushes is None:
                from prefill.tp_kv import PrefillRankKV

                self.pushes = PrefillRankKV(self.engine, self.plan, kind=PUSHED)
            return self.pushes.handle(msg)
        if msg["op"] == "kv_adopt":
            self.threads.submit(self._adopt, msg)
        elif msg["op"] == "kv_abort":
            for tid in piece_ids(msg["rid"], self.engine, split_in(msg)):
                self.receiver.abort(tid)

    def _adopt(self, msg: dict) -> None:
        rank = rank_of(self.engine)
        try:
            pieces = collect(self.receiver, msg["rid"], self.engine, split_in(msg), msg["timeout"])
            phases = write(self.engine, pieces, msg["table"])
        except (TransferError, TimeoutError) as e:
            self.plan.report(kind="adopted", rid=msg["rid"], rank=rank, ok=False, error=str(e))
            return
        self.plan.report(kind="adopted", rid=msg["rid"], rank=rank, ok=True, phases=phases.to_dict())
