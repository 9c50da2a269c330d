"""Moving a decoding request from one decode worker to another while it streams (the source's side:
``decode.migrate``).

1. ``start``: ``precopy {rid, kv_dest}`` to the worker decoding the request (the source), with the target's KV
   address: it sends the KV of the request's full blocks ahead while the request decodes on there, then says
   ``precopied {tokens}`` (``decode.migrate``; the target holds them, ``decode.precopy``). Then ``migrate {rid,
   kv_dest, kv_skip}``: the source pauses the request and sends only the KV after those tokens, so the pause lasts
   the push of a block or two and the switch, whatever the context. (A tensor-parallel target, several addresses,
   a pipeline, its stages' layers and addresses, or an MLX one, which has no blocks to hold them in: ``migrate``
   at once, everything at the pause.)
2. ``paused {resume}`` from the source: every token it has is out and it emits nothing more for the request; the
   router sends the target ``decode`` with that state (``earlier``: the output tokens before the last), as after a
   prefill (``precopied``: the tokens whose KV is held there already), while the source pushes the KV over the
   cluster's transport (``moved``, with its phases).
3. The target's first ``tokens`` or ``done``: ``release`` to the source (its blocks come back), and the request is
   the target's (its load, where an abort goes, whose silence the stall watchdog blames).

A ``migrate_failed`` from the source (the request was not decoding there, or its KV could not be sent), or an
``error`` from the target before its first token (no KV, no room, dead), ends the move: the source decodes on
(``unpause``) and the client notices nothing. A source lost after ``paused`` (its KV may never come) has the
target compute the request's tokens again instead (``generate`` with the paused state, ``earlier`` included) and go
on from the token after the client's last, as a retry would; a source lost before ``paused`` fails the request as
any decode worker lost mid-stream does. Tokens keep their order (the source is silent from ``paused`` until
``unpause``, the target starts at the token after the source's last), so a request is never lost or doubled by a
move. Counted in ``pdserve_migrations_total{reason,outcome}``, the stall (from ``paused`` to the target's first
token) in ``pdserve_migration_stall_seconds``, the KV like any transfer's (``transport`` label ``NAME-migration``)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .waits import DECODING
from .workers import SOURCE

log = logging.getLogger(__name__)
OPS = ("precopied", "paused", "moved", "migrate_failed")


@dataclass
class Move:
    source: object  # WorkerClient
    target: object
    reason: str  # drain | rebalance | admin
    kv_dest: object = None  # the target's KV address (one per rank of a group)
    ahead: int = 0  # tokens whose KV the source sent ahead (precopied)
    paused_at: float | None = None
    kv_bytes: int = 0
    resume: dict | None = None  # the source's state at ``paused``
    recomputed: bool = False  # the source was lost: the target computes the tokens again


class Migrations:
    def __init__(self, metrics, admission, dispatch):
        self.metrics, self.admission = metrics, admission
        self.dispatch = dispatch  # Service._dispatch: a worker's part of a request counted, owned and sent

    @staticmethod
    def movable(run) -> bool:
        """Decoding on a worker (not waiting for its KV or its prompt, not moving already)."""
        return run.state == DECODING and run.move is None and run.first is not None and run.where is not None

    async def start(self, run, target, reason: str) -> bool:
        """Ask ``run``'s decode worker to move it to ``target``; False where it cannot start."""
        source, stages = run.where, target.info.get("kv_stages")
        kv_addr = {"stages": stages} if stages else target.info.get("kv_addr")  # a pipeline: each stage its layers
        if not self.movable(run) or source is target or not kv_addr \
                or target in run.ignore:  # one that failed it once: its late errors must not pass for a new move's
            return False
        run.move = Move(source, target, reason, kv_addr)
        ahead = isinstance(kv_addr, str) and target.info.get("engine") != "mlx"  # (blocks to hold them in)
        await source.send("precopy" if ahead else "migrate", rid=run.attempt_rid, kv_dest=kv_addr)
        return True

    async def on_message(self, run, msg: dict) -> bool:
        """A message of a request that is moving; True where it was the move's own (not for the client)."""
        move, op = run.move, msg["op"]
        if op == "moved":  # (may come after the target streamed: the push's end reaches the source late)
            if isinstance(msg.get("phases"), dict):
                self.metrics.observe_transfer(f"{run.timing.get('transport') or 'kv'}-migration", msg["phases"])
            return True
        if move is None:  # a late word of a move that ended
            if op == "paused" and msg.get(SOURCE) is not None:
                await msg[SOURCE].send("unpause", rid=run.attempt_rid)
            return op in OPS
        if op == "precopied":
            move.ahead = int(msg.get("tokens") or 0)
            if isinstance(msg.get("phases"), dict):
                self.metrics.observe_transfer(f"{run.timing.get('transport') or 'kv'}-migration", msg["phases"])
            await move.source.send("migrate", rid=run.attempt_rid, kv_dest=move.kv_dest, kv_skip=move.ahead)
            return True
        if op == "paused":
            move.paused_at, move.kv_bytes = time.monotonic(), int(msg.get("kv_bytes") or 0)
            if isinstance(msg.get("phases"), dict) and "kv" not in run.timing:  # the handoff to the first decode worker
                run.timing["kv"] = msg["phases"]
                if not run.warm:
                    self.metrics.observe_transfer(run.timing.get("transport") or "kv", msg["phases"])
            r = move.resume = msg["resume"]
            await self.dispatch(move.target, run.involved, run.attempt_rid, "decode", first_token=r["first_token"],
                                prompt_ids=r["prompt_ids"], earlier=r["earlier"], emitted=r["emitted"],
                                params=r["params"], kv_tp=int(r.get("kv_tp") or 1),
                                precopied=int(r.get("kv_skip") or 0), **({"kv_pp": r["kv_pp"]} if r.get("kv_pp") else {}))
            return True
        if op == "migrate_failed":
            await self._end(run, "failed", msg.get("message"))
            return True
        if op in ("tokens", "done") and msg.get(SOURCE) is move.target:
            await self._switch(run)
        return False

    async def _switch(self, run) -> None:
        """The target streams: the request is its own from here."""
        move, rid = run.move, run.attempt_rid
        if not move.recomputed:  # (a lost source was let go at once)
            await move.source.send("release", rid=rid)
            move.source.release(rid)
            move.source.owned.discard(rid)
            if move.source in run.involved:
                run.involved.remove(move.source)
        run.where = run.workers["decode"] = move.target
        self.admission.move(rid, move.target)
        stall = time.monotonic() - move.paused_at if move.paused_at is not None else 0.0
        self.metrics.migration_stall.observe(stall)
        run.timing.setdefault("migrations", []).append(
            {"from": move.source.address, "to": move.target.address, "reason": move.reason,
             "stall_ms": round(stall * 1e3, 1), "kv_bytes": move.kv_bytes, "sent_ahead_tokens": move.ahead})
        await self._end(run, "recomputed" if move.recomputed else "moved")

    async def failed(self, run, failure) -> bool:
        """An ``error`` while ``run`` moves: True where it was the target's (the source decodes on), came from a
        target given up already, or was the loss of a paused source (the target computes the tokens again); False
        where the request itself failed."""
        move = run.move
        if failure.source in run.ignore:
            return True
        if move is not None and failure.source is move.source and failure.msg.get("lost") and move.resume \
                and not move.recomputed:
            await self._recompute(run)
            return True
        if move is None or failure.source is not move.target:
            return False
        if move.recomputed:  # no source to go back to
            return False
        await move.source.send("unpause", rid=run.attempt_rid)
        await self._end(run, "failed", failure.message)
        return True

    async def _recompute(self, run) -> None:
        """The source was lost after pausing: the target drops its wait for the KV and computes the prompt and the
        tokens so far again, going on from the token after the client's last (``decode.local``; no ``abort`` before
        it: one for the same id could overtake the new work there)."""
        move, rid, r = run.move, run.attempt_rid, run.move.resume
        log.warning("request %s: %s was lost while it moved; %s computes its %d tokens again", run.rid,
                    move.source.address, move.target.address, len(r["prompt_ids"]) + len(r["earlier"]) + 1)
        move.recomputed = True
        run.cached_tokens = run.cached_by_tier = None  # the target's done says what it took from its cache
        if move.source in run.involved:
            run.involved.remove(move.source)
            move.source.release(rid)
        move.source.owned.discard(rid)
        run.where = move.target  # whose silence the stall watchdog blames from here
        await move.target.send("generate", rid=rid, resume={"prompt_ids": r["prompt_ids"], "token": r["first_token"],
                                                            "earlier": r["earlier"], "emitted": r["emitted"],
                                                            "params": r["params"]})
        move.target.owned.add(rid)

    async def _end(self, run, outcome: str, why: str | None = None) -> None:
        move, run.move = run.move, None
        self.metrics.migrations.labels(move.reason, outcome).inc()
        if outcome in ("moved", "recomputed"):
            return
        log.warning("request %s: moving it from %s to %s failed (%s); it decodes on where it was",
                    run.rid, move.source.address, move.target.address, why)
        if move.paused_at is not None:  # the target was asked: it lets the request go, and its word is ignored
            rid = run.attempt_rid
            run.ignore.add(move.target)
            if move.target in run.involved:
                run.involved.remove(move.target)
                move.target.release(rid)
            move.target.owned.discard(rid)
            try:
                await move.target.send("abort", rid=rid)
            except Exception:  # noqa: BLE001 - a dead target's abort goes nowhere
                pass
