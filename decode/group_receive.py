"""Rank 0's side of KV arriving in pieces (``decode.tp_kv`` has the protocol): whenever the prefill is a group or a
pipeline, or this worker is one."""
from __future__ import annotations

import queue
import threading

from kvtransfer import TransferError, TransferStatus
from kvtransfer.phases import merge_ranks

from .tp_kv import collect, piece_ids, release, split_in, write


class GroupReceive:
    def __init__(self, worker, wait_s: float = 120.0):
        self.worker, self.engine = worker, worker.engine
        stages = getattr(getattr(self.engine, "stage", None), "stages", None)
        self.spans = stages.spans if stages is not None else None
        self.size = len(self.spans) if stages is not None else self.engine.group.size
        self.plan = stages.plan if stages is not None else \
            self.engine.group.plan if getattr(self.engine, "paged", True) else None  # mlx: whole heads
        self.addresses: dict[int, str] = {}
        self.reports: dict[str, list] = {}
        self._cond = threading.Condition()
        if self.plan is not None:
            self.plan.on_report = self._on_report
            while stages is not None:  # what the stages reported before this handler was in place
                try:
                    self._on_report(stages.reports.get_nowait())
                except queue.Empty:
                    break
            with self._cond:
                if not self._cond.wait_for(lambda: len(self.addresses) == self.size - 1, wait_s):
                    raise RuntimeError(f"decode ranks did not announce their KV receivers within {wait_s:.0f}s")

    def kv_addr(self, own: str):
        if self.plan is None or self.spans is not None:
            return own
        return [own] + [self.addresses[r] for r in range(1, self.size)]

    def kv_stages(self, own: str) -> list | None:
        """``[[first, end, address], ...]``: where each stage of this pipeline takes its layers (None without)."""
        if self.spans is None:
            return None
        addresses = [own] + [self.addresses[s] for s in range(1, self.size)]
        return [[first, end, a] for (first, end), a in zip(self.spans, addresses)]

    def _on_report(self, msg: dict) -> None:
        with self._cond:
            if msg.get("kind") == "address":
                self.addresses[msg["rank"]] = msg["address"]
                self._cond.notify_all()
                return
            if msg.get("rid") in self.reports:
                self.reports[msg["rid"]].append(msg)
                if len(self.reports[msg["rid"]]) == self.size - 1:
                    self.worker.inbox.put({"op": "_adopted", "rid": msg["rid"]})

    @staticmethod
    def sliced(msg: dict, engine) -> bool:
        return msg.get("kv_pp") is not None or msg.get("kv_tp", 1) != 1 or \
            (getattr(engine, "paged", True) and engine.group.size > 1)

    @staticmethod
    def split(msg: dict, engine) -> dict | None:
        """How the prefill split the KV (``tp_kv.own_pieces``), or None when this model cannot be split so: the
        stages' layers must cover the model's, in order."""
        from engine.parallel.heads import check_tp

        split = split_in(msg)
        spans, value = split["kv_pp"], split["kv_tp"]
        if spans is not None:
            ok = isinstance(spans, list) and spans and all(
                isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) and s[0] < s[1] for s in spans)
            if not (ok and spans[0][0] == 0 and spans[-1][1] == engine.model_kv_shape[0]
                    and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))):
                return None
        if type(value) is not int or not 1 <= value <= 1024:
            return None
        if not getattr(engine, "paged", True):
            return split if value <= engine.kv_shape[1] else None
        try:
            check_tp(engine.model.spec.num_heads, engine.model.spec.num_kv_heads, value)
        except ValueError:
            return None
        return split

    def status(self, rid: str, split: dict) -> TransferStatus:
        """DONE when all of rank 0's own pieces are in, FAILED when one failed, else PENDING."""
        states = [self.worker.receiver.poll(t) for t in piece_ids(rid, self.engine, split)]
        if any(s in (TransferStatus.FAILED, TransferStatus.ABORTED) for s in states):
            return TransferStatus.FAILED
        return TransferStatus.DONE if all(s == TransferStatus.DONE for s in states) else TransferStatus.PENDING

    def try_start(self, rid: str) -> None:
        """(Engine thread) Start ``rid`` once rank 0's pieces and the ``decode`` message are in: blocks, own pieces
        written, followers told (``finish`` when they have placed theirs)."""
        w = self.worker
        msg, _ = w.waiting[rid]
        split = self.split(msg, self.engine)
        if split is None:
            del w.waiting[rid]
            return w.fail(rid, 400, f"bad decode request: kv_tp {msg.get('kv_tp')!r} / kv_pp {msg.get('kv_pp')!r} "
                                    f"cannot split this model")
        if not getattr(self.engine, "paged", True):
            del w.waiting[rid]
            self.abort(rid, split)
            return w.fail(rid, 400, f"an mlx decode worker takes the KV whole, from a prefill worker of one rank "
                                    f"(this one is a group of {msg.get('kv_tp')})")
        status = self.status(rid, split)
        if status == TransferStatus.PENDING:
            return
        del w.waiting[rid]
        if status == TransferStatus.FAILED:
            self.abort(rid, split)
            return w.fail(rid, 502, "KV transfer failed (a piece failed or was aborted)", stage="kv_recv")
        try:
            pieces = collect(w.receiver, rid, self.engine, split, 0)
        except (TransferError, TimeoutError) as e:
            self.abort(rid, split)
            return w.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
        table = self._blocks(rid, msg, pieces[0][0].layout.num_tokens, split)
        if table is None:
            return release(pieces)
        seq, prefix, table = table
        phases = write(self.engine, pieces, table)
        w.adopting[rid] = (seq, prefix + table, phases, split)
        if self.adopt(rid, split, table):
            self.finish(rid)

    def _blocks(self, rid, msg, tokens, split):
        """``(sequence, held prefix, blocks for the KV)``, or None once the request failed."""
        from engine import RequestError
        from engine.requests import resumed_sequence

        w = self.worker
        try:
            seq = resumed_sequence(self.engine, rid, msg["prompt_ids"], msg["first_token"], msg["emitted"],
                                   msg["params"], msg.get("earlier"))
            prefix = w._prefix(rid, seq, tokens)
        except (KeyError, TypeError, RequestError) as e:
            self.abort(rid, split)
            return w.fail(rid, 400, f"bad decode request: {e}")
        if not w.reserve_budget(rid, len(seq.prompt_ids), seq.params):
            self.engine.release(prefix)
            return self.abort(rid, split)
        table = w.landing.pop(rid, None) or self.engine.reserve(tokens)
        if table is None:
            self.engine.release(prefix)
            w.reserved.pop(rid, None)
            self.abort(rid, split)
            return w.fail(rid, 503, "no free KV blocks for the arriving KV", retry_after=1)
        return seq, prefix, table

    def finish(self, rid: str) -> None:
        """(Engine thread) Every rank placed its pieces: the sequence starts (or fails, its blocks returned)."""
        w = self.worker
        entry = w.adopting.pop(rid, None)
        if entry is None:
            return
        seq, table, phases, split = entry
        try:
            reports = self.adopted(rid)
        except TransferError as e:
            self.engine.release(table)
            w.reserved.pop(rid, None)
            self.abort(rid, split)
            return w.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
        self.engine.adopt(seq, table)
        w.start_live(seq, merge_ranks(phases, [{"rank": r["rank"], "phases": r["phases"]} for r in reports]))

    def adopt(self, rid: str, split: dict, table: list) -> bool:
        """Tell the followers to place their pieces in ``table``; True when there are none (start now)."""
        if self.plan is None:
            return True
        with self._cond:
            self.reports[rid] = []
        self.plan.send("kv_adopt", rid=rid, table=list(table), timeout=self.worker.kv_timeout, **split)
        return False

    def adopted(self, rid: str) -> list[dict]:
        """The followers' reports; raises TransferError when one failed."""
        with self._cond:
            reports = self.reports.pop(rid, [])
        failed = [r for r in reports if not r.get("ok")]
        if failed:
            raise TransferError(f"rank {failed[0]['rank']}: {failed[0].get('error')}")
        return reports

    def abort(self, rid: str, split: dict) -> None:
        """Drop ``rid``'s pieces on every rank (and blocks it holds while followers place theirs)."""
        entry = self.worker.adopting.pop(rid, None)
        if entry is not None:
            self.engine.release(entry[1])
            self.worker.reserved.pop(rid, None)
        for tid in piece_ids(rid, self.engine, split):
            self.worker.receiver.abort(tid)
        with self._cond:
            self.reports.pop(rid, None)
        if self.plan is not None:
            self.plan.send("kv_abort", rid=rid, **split)
