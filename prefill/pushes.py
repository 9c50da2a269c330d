"""What prefill and mixed workers share about a KV push: the part of a prompt's KV it sends (``kv_suffix``) and
what the worker does when it ends (``push_ended``)."""
from __future__ import annotations

from kvtransfer import KVLayout
from kvtransfer.convert import layout_for


def kv_suffix(engine, seq, skip: list) -> tuple[KVLayout, list[int], int]:
    """The layout and blocks of the KV to send, and how many leading blocks are not sent: those whose keys the
    decode worker holds (``skip``, from the router; only those equal to this prompt's own keys count; at least one
    token goes)."""
    bs, n = engine.block_size, len(seq.prompt_ids)
    m = 0
    if skip:
        own = engine.scheduler.keys(seq, n)
        limit = min(len(skip), len(own), (n - 1) // bs)
        while m < limit and skip[m] == own[m]:
            m += 1
    layout = layout_for(engine.kv_shape, n - m * bs, engine.kv_dtype, engine.kv_scales)
    return layout, seq.block_table[m:], m


def push_ended(worker, msg: dict) -> None:
    """(Engine thread) A push ended (``_sent``): the blocks it read from come back; after a success the request is
    done on this worker (after a failure the error already went out)."""
    seq = worker.sending.pop(msg["rid"], None)
    if seq is not None:
        worker.engine.free(seq)
    if msg.get("ok"):
        worker.reply_to.pop(msg["rid"], None)
