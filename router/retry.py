"""Retrying a request on other workers before its client has seen anything a retry could change.

A request runs as one or more attempts, each under its own id (``rid``, then ``rid~1``, ``rid~2``, ...), so a
worker never mixes one attempt's messages with another's. A worker's ``error`` with status 502 or 503 ends the
attempt: the worker died or stopped answering (the router fails what it owned, ``lost``), the KV transfer failed
(``stage``: ``kv_send`` from the prefill side, ``kv_recv`` from the decode side), its queue or KV budget was full,
or it shut down. If decode has streamed no token yet, the request runs again, at most ``retries`` times, on
workers other than the ones that failed it where others are healthy; the worker a KV transfer could not reach is
also suspect for a while (out of every request's picks).

The first token comes from prefill before the KV moves, so a failed handoff can come after the client has it. A
retry then keeps that token: a prefill worker computes the prompt's KV again and sends it to another decode worker,
which continues from the token the client already has (colocated: the worker recomputes prompt + first token
itself). Nothing the client saw is replayed or changed.

A worker lost while it streams (dead, silent past ``dead_after_s``, or exiting because a rank or stage of it died)
costs its requests nothing either: the router has every token it sent on (``output_ids``) and the text they made
(``emitted``), so the next attempt has another worker (colocated, or decode) compute the prompt and those tokens
again and go on after the client's last (``resume_state``): greedy output goes on as the whole one would have. A stalled stream (the worker alive, its
request stuck) still ends with an error event, as do other errors (400s, 500s, timeouts), which are never
retried."""
from __future__ import annotations

from dataclasses import dataclass, field

RETRYABLE_STATUS = (502, 503)


class StreamError(Exception):
    def __init__(self, status: int, message: str, retry_after=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class WorkerFailure(StreamError):
    """An ``error`` message from (or on behalf of) a worker; ``msg`` is the message, ``source`` its client."""

    def __init__(self, msg: dict, source):
        super().__init__(int(msg.get("status") or 500), str(msg.get("message") or "worker error"),
                         msg.get("retry_after"))
        self.msg = msg
        self.source = source

    @property
    def reason(self) -> str:
        """The label of ``pdserve_request_retries_total``."""
        if self.msg.get("stage") in ("kv_send", "kv_recv"):
            return "kv_transfer"
        role = getattr(self.source, "role", "worker")
        if self.msg.get("lost"):
            return f"{role}_lost"
        return f"{role}_unavailable" if self.status == 503 else f"{role}_error"


GONE_STAGES = ("tp_rank_lost", "pp_stage_lost")  # a rank or stage of the worker died: it exits and restarts


def worker_gone(failure: WorkerFailure) -> bool:
    """The worker is lost (dead, silent, or giving up after a rank or stage died), not just failing this request."""
    return bool(failure.msg.get("lost")) or failure.msg.get("stage") in GONE_STAGES


@dataclass
class RequestRun:
    """One request across its attempts."""
    rid: str
    payload: dict
    t0: float
    attempt: int = 0
    first: dict | None = None  # the first-token message the client was given
    streamed: bool = False  # decode tokens reached the client: a retry resumes after them (``resume_state``)
    output_ids: list = field(default_factory=list)  # the tokens the client has after the first
    emitted: int = 0  # the characters of text they made
    avoid: set = field(default_factory=set)
    workers: dict = field(default_factory=dict)  # role -> the client the current attempt uses
    reasons: list = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    local: bool = False  # this attempt's prompt is computed where it decodes (colocated, or --disagg local)
    warm: bool = False  # a pair's warm-up (router.warmup): pinned by ``avoid``, counted in no metric
    uncached: int = 0  # prompt tokens the decode worker does not hold (``--disagg auto`` only; else 0)
    cached_tokens: int | None = None  # prompt tokens the worker that computed the KV in use took from its cache
    cached_by_tier: dict | None = None  # the same by tier; both None until it said (``router.timing.note_cached``)
    state: str = "queued"  # where the current attempt stands (``router.waits``)
    where: object = None  # the worker client it waits on
    since: float = 0.0  # when the current attempt began (monotonic)
    last: float | None = None  # when a message of it last came
    stalled: bool = False  # the current attempt ended in the stall watchdog
    involved: list = field(default_factory=list)  # the workers the current attempt asked for work
    move: object = None  # router.migration.Move while it moves to another decode worker
    ignore: set = field(default_factory=set)  # workers whose errors no longer concern it (a move's abandoned target)

    @property
    def attempt_rid(self) -> str:
        return self.rid if self.attempt == 0 else f"{self.rid}~{self.attempt}"

    def may_retry(self, failure: StreamError, retries: int) -> bool:
        retryable = failure.status in RETRYABLE_STATUS or bool(getattr(failure, "msg", {}).get("stalled"))
        if not (isinstance(failure, WorkerFailure) and retryable and self.attempt < retries):
            return False
        return not self.streamed or (self.first is not None and worker_gone(failure))

    def resume_state(self) -> dict:
        """What a worker needs to go on after the client's last token: the prompt and every token before it
        computed again (``decode.local``)."""
        ids = [self.first["token"], *self.output_ids]
        return {"token": ids[-1], "earlier": ids[:-1], "prompt_ids": self.first["prompt_ids"],
                "emitted": self.first["emitted"] + self.emitted, "params": self.first["params"]}

    def blame(self, failure: WorkerFailure) -> None:
        """Keep the next attempt off the workers that failed this one; a decode worker the KV could not reach
        is suspect for every request."""
        stage, workers = failure.msg.get("stage"), self.workers
        if failure.source is not None:
            self.avoid.add(failure.source)
        if stage == "kv_send" and workers.get("decode") is not None:
            self.avoid.add(workers["decode"])
            workers["decode"].suspect(failure.message)
        if stage == "kv_recv" and workers.get("prefill") is not None:
            self.avoid.add(workers["prefill"])
        self.reasons.append(failure.reason)
        self.attempt += 1
