"""Control messages (version 1): msgpack maps ``{"v": 1, "op": ..., ...}``.

router -> prefill   ping | prefill{rid, prompt, params, kv_dest} | abort{rid}
router -> decode    ping | decode{rid, first_token, prompt_len, emitted, params} | abort{rid}
router -> colocated ping | generate{rid, prompt, params} | abort{rid}
worker -> router    pong{info} | first{rid, token, text, prompt_tokens, finish_reason, timing}
                    | tokens{rid, ids, text} | done{rid, finish_reason, completion_tokens, timing, phases}
                    | error{rid, status, message}
"""
from __future__ import annotations

import msgpack

VERSION = 1
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
