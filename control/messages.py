"""Control messages (version 4): msgpack maps ``{"v": 4, "op": ..., ...}``. Version 2: ``decode`` carries
the prompt's token ids and the parameters the prefill side resolved; ``first``/``tokens``/``done`` carry logprobs.
Version 3: a worker sends what one engine step produced for one router as a single ``batch`` of messages.
Version 4: a decoding request moves between decode workers (``router.migration``, ``decode.migrate``): ``decode``
may carry ``earlier`` (the output tokens before ``first_token``), and the ``migrate`` ops below. Optional fields
added since (a reader ignores what it does not know): ``cached_tokens`` and ``cached_tokens_by_tier`` on ``first``
and a colocated ``done`` (``prefill.cached``).

router -> prefill   ping | prefill{rid, prompt | messages + chat, params, kv_dest} | abort{rid}
router -> decode    ping | decode{rid, first_token, prompt_ids, emitted, params (resolved)[, earlier]} | abort{rid}
                    | migrate{rid, kv_dest} | release{rid} | unpause{rid}
router -> colocated ping | generate{rid, prompt, params} | abort{rid}
worker -> router    pong{info} | first{rid, token, text, prompt_tokens, prompt_ids, params, finish_reason,
                          logprobs, timing, cached_tokens, cached_tokens_by_tier[, prompt_text, prompt_logprobs]}
                    | tokens{rid, ids, text, logprobs} | done{rid, finish_reason, completion_tokens, timing, phases, logprobs
                          [, cached_tokens, cached_tokens_by_tier: a colocated worker's]}
                    | error{rid, status, message}
                    | paused{rid, resume, kv_tokens, kv_bytes, phases} | moved{rid, phases} | migrate_failed{rid, message}
                    | batch{msgs: [any of the above with its rid, as a map with op and no v]}
"""
from __future__ import annotations

import msgpack

VERSION = 4
MAX_MESSAGE_BYTES = 8 << 20


class MessageError(ValueError):
    pass


def encode(op: str, **fields) -> bytes:
    return msgpack.packb({"v": VERSION, "op": op, **fields}, use_bin_type=True)


def decode(raw: bytes) -> dict:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} bytes over limit {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise MessageError(f"undecodable message: {e}") from None
    if not isinstance(msg, dict):
        raise MessageError("message is not a map")
    if msg.get("v") != VERSION:
        raise MessageError(f"message version {msg.get('v')!r} != {VERSION}")
    if not isinstance(msg.get("op"), str):
        raise MessageError("message has no op")
    rid = msg.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise MessageError("rid must be a string")
    return msg


def unbatch(msg: dict) -> list[dict]:
    """The messages inside a ``batch`` (each checked like a message of its own), or ``[msg]``."""
    if msg["op"] != "batch":
        return [msg]
    items = msg.get("msgs")
    if not isinstance(items, list):
        raise MessageError("batch without a list of msgs")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("op"), str) or item["op"] == "batch" \
                or not isinstance(item.get("rid"), str):
            raise MessageError("batch item is not a message with op and rid")
    return items
