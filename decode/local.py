"""Prompts a decode worker computes itself (``generate``): colocated serving, a local prefill (``--disagg``), a
retry whose client has its first token from a worker that failed, and a moved request whose source was lost.

With ``resume`` the request goes on from a token its client already has: prompt and tokens (``earlier``, those
before it, for a move) are computed again and nothing is sent for them, no ``first`` either. A ``resume`` for a
request this worker waits to receive the KV of (the router had asked it to take the move over) drops that wait
first; one for a request already decoding here (its KV came after all) is ignored: it goes on as it is."""
from __future__ import annotations

from engine import RequestError
from engine.requests import new_sequence, resumed_sequence


def generate(worker, msg: dict) -> None:
    rid, resume = msg["rid"], msg.get("resume")
    if isinstance(resume, dict) and rid in worker.live:
        return
    if isinstance(resume, dict):
        worker.drop_wait(rid)
    try:
        if isinstance(resume, dict):
            seq = resumed_sequence(worker.engine, rid, resume.get("prompt_ids"), resume.get("token"),
                                   resume.get("emitted"), resume.get("params"), resume.get("earlier"))
        else:
            seq = new_sequence(worker.engine, rid, msg)
    except RequestError as e:
        return worker.fail(rid, e.status, str(e))
    if not worker.reserve_budget(rid, len(seq.prompt_ids), seq.params):
        return
    worker.engine.add(seq)
    worker.start_local(seq)
