"""A request's inbox on the router: worker messages for one request id, read in order."""
from __future__ import annotations

import asyncio


def coalesce(msg: dict, inbox: asyncio.Queue) -> dict:
    """``msg`` (``tokens``) joined with the ``tokens`` messages already waiting behind it: a client (or a router)
    that fell behind gets them as one event. Stops before any other message, which stays first in the inbox."""
    queued = inbox._queue  # noqa: SLF001 - a peek; asyncio.Queue has no public one
    if not queued or queued[0].get("op") != "tokens":
        return msg
    text, ids, logprobs = [msg["text"]], list(msg["ids"]), msg.get("logprobs")
    logprobs = list(logprobs) if logprobs is not None else None
    while queued and queued[0].get("op") == "tokens":
        more = inbox.get_nowait()
        text.append(more["text"])
        ids += more["ids"]
        if logprobs is not None:
            logprobs += more.get("logprobs") or []
    return {**msg, "text": "".join(text), "ids": ids, "logprobs": logprobs}
