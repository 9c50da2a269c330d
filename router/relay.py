"""The messages of one attempt after its prompt is sent, relayed to the client.

``first_message`` waits for the prefill (or colocated) worker's ``first``: ``progress`` updates the request's state
for the stall watchdog, ``kv_sent`` (a streamed KV can be in place before the first token) closes the transfer's
figures, and a ``tokens`` or ``done`` before it is the worker's failure. ``relay_tokens`` then yields decode's tokens
as ``Delta`` events up to ``done`` and a closing ``Finished``, checks each message's token index, keeps what the
client has (``run.output_ids``, ``run.emitted``) so that a lost worker's stream resumes after it, and hands a stream
being moved, or lost, to ``router.migration``."""
from __future__ import annotations

import logging

from .events import Delta, Finished
from .inbox import coalesce
from .migration import OPS as MOVE_OPS
from .retry import RequestRun, WorkerFailure
from .timing import await_kv_sent, close_timing, kv_sent, note_cached, note_hops
from .waits import DECODING, PREFILLING, QUEUED, check_index

log = logging.getLogger(__name__)


async def first_message(svc, inbox, run: RequestRun, first_worker) -> dict:
    """The ``first`` message (a streamed KV can be in place before the first token is out)."""
    while True:
        msg = await svc.waits.next(inbox, svc.first_timeout_s, "the first token", run)
        op = msg["op"]
        if op == "first":
            return msg
        if op == "progress":
            run.state = PREFILLING if msg.get("state") == PREFILLING else QUEUED
        elif op == "kv_sent":
            first_worker.owned.discard(msg["rid"])
            kv_sent(run, msg, svc.figures_for(run))
        elif op in ("tokens", "done"):  # never dropped: the client would wait for a first token that has gone
            log.error("request %s: %s worker %s sent %r before the first token", msg["rid"],
                      first_worker.role, first_worker.address, op)
            raise WorkerFailure({"status": 502, "message": f"{first_worker.role} worker sent {op!r} before the "
                                 "first token"}, first_worker)
        else:
            log.warning("request %s: unexpected %r while waiting for the first token", msg["rid"], op)

async def relay_tokens(svc, run: RequestRun, inbox, first_worker):
    """Decode's tokens up to ``done``, then ``Finished``; the tokens the client has are kept (``run.output_ids``)
    for a resume."""
    timing, completion = run.timing, 1 + len(run.output_ids)
    while True:
        try:
            msg = await svc.waits.next(inbox, svc.token_timeout_s, "the next token", run)
        except WorkerFailure as failure:
            if await svc.migrations.failed(run, failure):
                continue
            raise
        if (run.move is not None or msg["op"] in MOVE_OPS) and await svc.migrations.on_message(run, msg):
            continue
        if msg["op"] in ("tokens", "done"):
            run.state = DECODING
            check_index(msg, completion)
        if msg["op"] == "kv_sent":
            first_worker.owned.discard(msg["rid"])
            kv_sent(run, msg, svc.figures_for(run))
        elif msg["op"] == "progress":
            pass
        elif msg["op"] == "tokens":
            msg = coalesce(msg, inbox)
            completion += len(msg["ids"])
            run.streamed = True
            run.output_ids += msg["ids"]
            run.emitted += len(msg["text"])
            yield Delta(msg["text"], msg["ids"], msg.get("logprobs"))
        elif msg["op"] == "done":
            completion = msg.get("completion_tokens", completion + len(msg["ids"]))
            run.streamed = True
            yield Delta(msg["text"], msg["ids"], msg.get("logprobs"))
            timing["decode"] = msg.get("timing", {}).get("decode", 0.0)
            if run.cached_tokens is None:  # a prompt computed again where it decodes, without a first
                note_cached(run, msg)
            note_hops(run, "decode", msg.get("timing"))
            if msg.get("phases") and "migrations" not in timing:  # a moved one's came with its pause
                timing["kv"] = msg["phases"]
                if svc.figures_for(run) is not None:
                    svc.metrics.observe_transfer(timing["transport"], msg["phases"])
            if not run.local and "overlap" not in timing:
                await await_kv_sent(inbox, run, svc.figures_for(run))
            yield Finished(msg["finish_reason"], run.first["prompt_tokens"], completion,
                           close_timing(run, svc.figures_for(run)), run.cached_tokens or 0)
            return
        else:
            log.warning("request %s: unexpected %r from a worker while decoding", msg["rid"], msg["op"])
