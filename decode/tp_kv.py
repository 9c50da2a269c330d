"""KV arriving in head slices: from a tensor-parallel prefill group, into a tensor-parallel decode group.

Each decode rank has its own receiver (``kv_addr`` is then the list of
them, rank order) and receives the slices ``heads.recv_pieces`` names for
it, each its own transfer (``heads.piece_id``; a rank's whole heads in one
piece keep the request id, so a piece into a one-device worker from a
one-device prefill is the plain transfer). The ``decode`` message carries
the prefill group's size (``kv_tp``).

Rank 0 (``GroupReceive``), once its own slices are in and the ``decode``
message is here: reserves the blocks (or takes the ones its whole piece
landed in), writes its slices into their heads, and sends
``kv_adopt{rid, table, kv_tp, timeout}`` on the plan. Each follower
(``DecodeRankKV``) waits for its slices, writes them into the same blocks of
its own pool, releases them and reports ``{kind: adopted, rid, rank, ok,
phases | error}``; with every report in, rank 0 starts the sequence (the
phases: the slowest rank's, every rank's in ``ranks``). ``kv_abort{rid}``
drops a request's slices on every rank. Followers announce their receiver
with ``{kind: address, rank, address}`` when they start."""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from engine.parallel.heads import kv_range, piece_id, recv_pieces
from kvtransfer import TransferError, TransferStatus, make_receiver
from kvtransfer import spec as transport_spec
from kvtransfer.phases import PhaseTimes, merge_ranks
from kvtransfer.convert import convert, needs_convert
from kvtransfer.tensors import unpack

log = logging.getLogger(__name__)


def own_pieces(engine, kv_tp: int) -> list[tuple[int, tuple[int, int], int]]:
    """``(first head, local head range, pieces)`` of this rank's slices from a prefill group of ``kv_tp``."""
    if getattr(engine, "paged", True):
        heads, size, rank = engine.model.spec.num_kv_heads, engine.group.size, engine.group.rank
    else:  # the mlx engine receives whole heads on rank 0
        heads, size, rank = engine.kv_shape[1], 1, 0
    pieces = recv_pieces(heads, kv_tp, size, rank)
    first = kv_range(heads, size, rank)[0]
    return [(lo, (lo - first, hi - first), len(pieces)) for lo, hi in pieces]


def piece_ids(rid: str, engine, kv_tp: int) -> list[str]:
    return [piece_id(rid, lo, n) for lo, _, n in own_pieces(engine, kv_tp)]


def collect(receiver, rid: str, engine, kv_tp: int, timeout: float) -> list:
    """This rank's slices of ``rid`` once all are in: ``(ReceivedKV, local head range)`` each (release them)."""
    out = []
    try:
        for lo, heads, n in own_pieces(engine, kv_tp):
            out.append((receiver.wait(piece_id(rid, lo, n), timeout), heads))
    except BaseException:
        release(out)
        raise
    return out


def release(pieces: list) -> None:
    for received, _ in pieces:
        received.release()


def write(engine, pieces: list, table: list) -> PhaseTimes:
    """Write each slice into its heads of ``table``'s blocks (a slice that landed there already is skipped) and
    release it; the phases summed over the slices."""
    total = PhaseTimes()
    try:
        for received, heads in pieces:
            if received.landed is None:
                if received.layers is not None:
                    views = received.layers
                else:
                    with received.phases.measure("deserialize"):
                        views = unpack(received.buffer, received.layout)
                if needs_convert(received.layout, engine.kv_dtype, engine.kv_scales):
                    with received.phases.measure("convert"):
                        views = convert(views, received.layout, engine.kv_dtype, engine.kv_scales)
                with received.phases.measure("h2d"):
                    engine.pool.scatter(table, views, heads=heads)
            for name, value in received.phases.to_dict().items():
                if name != "total":
                    setattr(total, name, getattr(total, name) + value)
    finally:
        release(pieces)
    return total


class DecodeRankKV:
    """A follower decode rank: its own receiver; places its slices when rank 0 says where."""

    def __init__(self, engine, plan):
        name, cfg = transport_spec.load(os.environ[transport_spec.ENV])
        cfg.port = 0
        if name == "nccl":  # this rank's GPU, not rank 0's
            cfg.options["device"] = str(engine.device)
        self.engine, self.plan, self.timeout = engine, plan, cfg.timeout_s
        self.receiver = make_receiver(name, cfg)
        self.receiver.start()
        self.threads = ThreadPoolExecutor(4, thread_name_prefix="kv-place")
        plan.report(kind="address", rank=engine.group.rank, address=self.receiver.address)

    def take_progress(self):
        return None

    def handle(self, msg: dict) -> None:
        if msg["op"] == "kv_adopt":
            self.threads.submit(self._adopt, msg)
        elif msg["op"] == "kv_abort":
            for tid in piece_ids(msg["rid"], self.engine, msg.get("kv_tp", 1)):
                self.receiver.abort(tid)

    def _adopt(self, msg: dict) -> None:
        rank = self.engine.group.rank
        try:
            pieces = collect(self.receiver, msg["rid"], self.engine, msg["kv_tp"], msg["timeout"])
            phases = write(self.engine, pieces, msg["table"])
        except (TransferError, TimeoutError) as e:
            self.plan.report(kind="adopted", rid=msg["rid"], rank=rank, ok=False, error=str(e))
            return
        self.plan.report(kind="adopted", rid=msg["rid"], rank=rank, ok=True, phases=phases.to_dict())


class GroupReceive:
    """Rank 0's side of slice-wise KV (used whenever the prefill or this worker is a group)."""

    def __init__(self, worker, wait_s: float = 120.0):
        self.worker, self.engine = worker, worker.engine
        self.plan = self.engine.group.plan if getattr(self.engine, "paged", True) else None  # mlx: whole heads
        self.addresses: dict[int, str] = {}
        self.reports: dict[str, list] = {}
        self._cond = threading.Condition()
        if self.plan is not None:
            self.plan.on_report = self._on_report
            with self._cond:
                if not self._cond.wait_for(lambda: len(self.addresses) == self.engine.group.size - 1, wait_s):
                    raise RuntimeError(f"decode ranks did not announce their KV receivers within {wait_s:.0f}s")

    def kv_addr(self, own: str):
        if self.plan is None:
            return own
        return [own] + [self.addresses[r] for r in range(1, self.engine.group.size)]

    def _on_report(self, msg: dict) -> None:
        with self._cond:
            if msg.get("kind") == "address":
                self.addresses[msg["rank"]] = msg["address"]
                self._cond.notify_all()
                return
            if msg.get("rid") in self.reports:
                self.reports[msg["rid"]].append(msg)
                if len(self.reports[msg["rid"]]) == self.engine.group.size - 1:
                    self.worker.inbox.put({"op": "_adopted", "rid": msg["rid"]})

    @staticmethod
    def sliced(msg: dict, engine) -> bool:
        return msg.get("kv_tp", 1) != 1 or (getattr(engine, "paged", True) and engine.group.size > 1)

    @staticmethod
    def kv_tp(msg: dict, engine) -> int | None:
        """The prefill group's size from a ``decode`` message, or None when no group of that size can hold this
        model's heads."""
        from engine.parallel.heads import check_tp

        value = msg.get("kv_tp", 1)
        if type(value) is not int or not 1 <= value <= 1024:
            return None
        if not getattr(engine, "paged", True):
            return value if value <= engine.kv_shape[1] else None
        try:
            check_tp(engine.model.spec.num_heads, engine.model.spec.num_kv_heads, value)
        except ValueError:
            return None
        return value

    def status(self, rid: str, kv_tp: int) -> TransferStatus:
        """DONE when all of rank 0's own slices are in, FAILED when one failed, else PENDING."""
        states = [self.worker.receiver.poll(t) for t in piece_ids(rid, self.engine, kv_tp)]
        if any(s in (TransferStatus.FAILED, TransferStatus.ABORTED) for s in states):
            return TransferStatus.FAILED
        return TransferStatus.DONE if all(s == TransferStatus.DONE for s in states) else TransferStatus.PENDING

    def try_start(self, rid: str) -> None:
        """(Engine thread) Start ``rid`` once rank 0's slices and the ``decode`` message are in: blocks, own slices
        written, followers told (``finish`` when they have placed theirs)."""
        w = self.worker
        msg, _ = w.waiting[rid]
        kv_tp = self.kv_tp(msg, self.engine)
        if not getattr(self.engine, "paged", True):
            del w.waiting[rid]
            self.abort(rid, kv_tp or 1)
            return w.fail(rid, 400, f"an mlx decode worker takes the KV whole, from a prefill worker of one rank "
                                    f"(this one is a group of {msg.get('kv_tp')})")
        if kv_tp is None:
            del w.waiting[rid]
            return w.fail(rid, 400, f"bad decode request: kv_tp {msg.get('kv_tp')!r} cannot split this model")
        status = self.status(rid, kv_tp)
        if status == TransferStatus.PENDING:
            return
        del w.waiting[rid]
        if status == TransferStatus.FAILED:
            self.abort(rid, kv_tp)
            return w.fail(rid, 502, "KV transfer failed (a slice failed or was aborted)", stage="kv_recv")
        try:
            pieces = collect(w.receiver, rid, self.engine, kv_tp, 0)
        except (TransferError, TimeoutError) as e:
            self.abort(rid, kv_tp)
            return w.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
        table = self._blocks(rid, msg, pieces[0][0].layout.num_tokens, kv_tp)
        if table is None:
            return release(pieces)
        seq, prefix, table = table
        phases = write(self.engine, pieces, table)
        w.adopting[rid] = (seq, prefix + table, phases, kv_tp)
        if self.adopt(rid, kv_tp, table):
            self.finish(rid)

    def _blocks(self, rid, msg, tokens, kv_tp):
        """``(sequence, held prefix, blocks for the KV)``, or None once the request failed."""
        from engine import RequestError
        from engine.requests import resumed_sequence

        w = self.worker
        try:
            seq = resumed_sequence(self.engine, rid, msg["prompt_ids"], msg["first_token"], msg["emitted"],
                                   msg["params"])
            prefix = w._prefix(rid, seq, tokens)
        except (KeyError, TypeError, RequestError) as e:
            self.abort(rid, kv_tp)
            return w.fail(rid, 400, f"bad decode request: {e}")
        if not w._reserve(rid, len(seq.prompt_ids), seq.params):
            self.engine.release(prefix)
            return self.abort(rid, kv_tp)
        table = w.landing.pop(rid, None) or self.engine.reserve(tokens)
        if table is None:
            self.engine.release(prefix)
            w.reserved.pop(rid, None)
            self.abort(rid, kv_tp)
            return w.fail(rid, 503, "no free KV blocks for the arriving KV", retry_after=1)
        return seq, prefix, table

    def finish(self, rid: str) -> None:
        """(Engine thread) Every rank placed its slices: the sequence starts (or fails, its blocks returned)."""
        w = self.worker
        entry = w.adopting.pop(rid, None)
        if entry is None:
            return
        seq, table, phases, kv_tp = entry
        try:
            reports = self.adopted(rid)
        except TransferError as e:
            self.engine.release(table)
            w.reserved.pop(rid, None)
            self.abort(rid, kv_tp)
            return w.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
        self.engine.adopt(seq, table)
        w.start_live(seq, merge_ranks(phases, [{"rank": r["rank"], "phases": r["phases"]} for r in reports]))

    def adopt(self, rid: str, kv_tp: int, table: list) -> bool:
        """Tell the followers to place their slices in ``table``; True when there are none (start now)."""
        if self.plan is None:
            return True
        with self._cond:
            self.reports[rid] = []
        self.plan.send("kv_adopt", rid=rid, table=list(table), kv_tp=kv_tp, timeout=self.worker.kv_timeout)
        return False

    def adopted(self, rid: str) -> list[dict]:
        """The followers' reports; raises TransferError when one failed."""
        with self._cond:
            reports = self.reports.pop(rid, [])
        failed = [r for r in reports if not r.get("ok")]
        if failed:
            raise TransferError(f"rank {failed[0]['rank']}: {failed[0].get('error')}")
        return reports

    def abort(self, rid: str, kv_tp: int) -> None:
        """Drop ``rid``'s slices on every rank (and blocks it holds while followers place theirs)."""
        entry = self.worker.adopting.pop(rid, None)
        if entry is not None:
            self.engine.release(entry[1])
            self.worker.reserved.pop(rid, None)
        for tid in piece_ids(rid, self.engine, kv_tp):
            self.worker.receiver.abort(tid)
        with self._cond:
            self.reports.pop(rid, None)
        if self.plan is not None:
            self.plan.send("kv_abort", rid=rid, kv_tp=kv_tp)
