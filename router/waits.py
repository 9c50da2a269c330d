"""Waiting on a request's inbox, and the stall watchdog.

Every wait for a worker's next message has a deadline: the wait's own limit
(``first_timeout_s`` for the first token, ``token_timeout_s`` between
tokens) and, sooner, the stall timeout (``--stall-timeout``; 0 turns it
off). Workers speak for a request whenever it moves: a token, or a
``progress`` message while its prompt is queued or computed (at most about
once a second, and only while their engine moves). So a request that hears
nothing for the stall timeout has stopped moving somewhere between the
worker's scheduler and this router: a message lost, a sequence the engine
no longer steps, a worker hung or gone quiet.

``Waits.expire`` (the router's tick) puts a mark in each inbox waited on past
its deadline; ``Waits.next`` turns the mark into the error: ``Stalled`` (the
state the request was in, the worker and role waited on; a ``WorkerFailure``,
so before its first byte reaches the client the request runs again on
another worker) or a plain 504 for the longer limits. ``Waits.stuck`` lists
the requests in flight longer than the stall timeout for ``/health``."""
from __future__ import annotations

import asyncio
import logging
import time

from .retry import StreamError, WorkerFailure
from .workers import SOURCE

EXPIRED = "_expired"
log = logging.getLogger(__name__)

# Where a request can stand, as the router sees it (the label of pdserve_requests_stalled_total):
QUEUED = "queued"  # sent to the worker that computes its prompt, not started there yet
PREFILLING = "prefilling"  # its prompt is being computed (the worker said so)
WAITING_KV = "waiting_for_kv"  # first token out, decode asked to continue, no decode token yet
DECODING = "decoding"


class Stalled(WorkerFailure):
    """No word about a request for the stall timeout."""

    def __init__(self, run, waited_s: float):
        worker = run.where
        role = getattr(worker, "role", "worker")
        address = getattr(worker, "address", "?")
        message = (f"request stalled: no progress for {waited_s:.0f}s while {run.state} on {role} worker "
                   f"{address}")
        super().__init__({"status": 504, "message": message, "stalled": True, "state": run.state}, worker)
        self.role, self.state = role, run.state

    @property
    def reason(self) -> str:
        return f"{self.role}_stalled"


class Waits:
    def __init__(self, stall_timeout_s: float = 30.0):
        self.stall_timeout_s = stall_timeout_s
        self.pending: dict[int, tuple] = {}  # id(inbox) -> (inbox, deadline, timeout, what, stall)
        self.runs: dict[str, object] = {}  # attempt id -> RequestRun, for /health

    def track(self, rid: str, run) -> None:
        run.state, run.since, run.last, run.stalled = QUEUED, time.monotonic(), None, False
        self.runs[rid] = run

    def untrack(self, rid: str) -> None:
        self.runs.pop(rid, None)

    async def next(self, inbox: asyncio.Queue, timeout: float, what: str, run=None) -> dict:
        """The inbox's next message; ``Stalled`` once the stall timeout passes without one (when ``run`` is given
        and that is the sooner limit), a 504 once ``timeout`` does; a worker's ``error`` as ``WorkerFailure``."""
        if inbox.empty():
            stall = run is not None and 0 < self.stall_timeout_s < timeout
            limit = self.stall_timeout_s if stall else timeout
            self.pending[id(inbox)] = (inbox, time.monotonic() + limit, limit, what, stall)
            try:
                msg = await inbox.get()
            finally:
                self.pending.pop(id(inbox), None)
        else:
            msg = inbox.get_nowait()
        if msg["op"] == EXPIRED:
            if msg["stall"]:
                raise Stalled(run, msg["timeout"])
            raise StreamError(504, f"timed out after {msg['timeout']:.0f}s waiting for {msg['what']}")
        if run is not None:
            run.last = time.monotonic()
        if msg["op"] == "error":
            raise WorkerFailure(msg, msg.get(SOURCE))
        return msg

    def expire(self) -> None:
        """(Every fraction of a second) Mark the inboxes waited on past their time."""
        now = time.monotonic()
        for key, (inbox, deadline, timeout, what, stall) in list(self.pending.items()):
            if now > deadline:
                del self.pending[key]
                inbox.put_nowait({"op": EXPIRED, "timeout": timeout, "what": what, "stall": stall})

    def stuck(self) -> list[dict]:
        """The requests in flight for longer than the stall timeout: where each stands and since when."""
        if self.stall_timeout_s <= 0:
            return []
        now, out = time.monotonic(), []
        for rid, run in list(self.runs.items()):
            age = now - run.since
            if age > self.stall_timeout_s:
                worker = run.where
                out.append({"rid": rid, "state": run.state, "role": getattr(worker, "role", None),
                            "worker": getattr(worker, "address", None), "age_s": round(age, 1),
                            "idle_s": round(now - (run.last or run.since), 1)})
        return out


def check_index(msg: dict, expected: int) -> None:
    """A token message names the place of its first token (``index``): one that skips or repeats places means
    tokens were lost on the way, and the stream ends with an error rather than a wrong text."""
    index = msg.get("index")
    if index is not None and index != expected:
        log.error("request %s: token %s arrived where token %d was due", msg.get("rid"), index, expected)
        raise StreamError(502, f"tokens lost between worker and router: got token {index}, expected {expected}")
