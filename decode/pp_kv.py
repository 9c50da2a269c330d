"""KV arriving in layer ranges into a decode worker without a paged pool (the mlx engine): from a pipelined prefill
worker, whose every stage sends its own layers here (``prefill.tp_kv.push_layers``), each range its own transfer
(``rid:L<first>``); a paged worker writes each range into its blocks as it is (``group_receive``).

The ``decode`` message carries the prefill's stages (``kv_pp``: ``[[first, end], ...]``). Once every range is in,
the pieces are joined in layer order and go on as one KV would (reservation, conversion, the engine). The phases
are the slowest piece's, bytes summed."""
from __future__ import annotations

import dataclasses

from engine.pipeline.split import layer_piece
from kvtransfer import TransferError, TransferStatus
from kvtransfer.convert import convert, needs_convert
from kvtransfer.phases import PHASES, PhaseTimes
from kvtransfer.tensors import unpack


class Pieces:
    """Received ranges standing as one ``ReceivedKV`` for the admission path: ``phases`` and ``release``."""

    def __init__(self, received: list):
        self.received = received
        self.phases = PhaseTimes(**{p: max(getattr(r.phases, p) for r in received) for p in PHASES},
                                 bytes=sum(r.phases.bytes for r in received))

    def release(self) -> None:
        for r in self.received:
            r.release()


def spans_of(msg: dict) -> list | None:
    spans = msg.get("kv_pp")
    if not isinstance(spans, list) or len(spans) < 2:
        return None
    ok = all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in spans)
    return spans if ok and spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) else []


def try_start(worker, rid: str) -> None:
    """(Engine thread) Start ``rid`` once each of its layer ranges is in (or fail it)."""
    msg, _ = worker.waiting[rid]
    spans = spans_of(msg)
    if not spans or spans[-1][1] != worker.engine.model_kv_shape[0]:
        worker.waiting.pop(rid)
        return worker.fail(rid, 400, f"bad decode request: kv_pp {msg.get('kv_pp')!r} does not cover the model's "
                                     f"{worker.engine.model_kv_shape[0]} layers")
    ids = [layer_piece(rid, first) for first, _ in spans]
    if any(worker.receiver.poll(t) in (TransferStatus.PENDING, TransferStatus.RECEIVING) for t in ids):
        return
    worker.waiting.pop(rid)
    received = []
    try:
        for t in ids:
            received.append(worker.receiver.wait(t, 0))
    except (TransferError, TimeoutError) as e:
        for r in received:
            r.release()
        for t in ids:
            worker.receiver.abort(t)
        return worker.fail(rid, 502, f"KV transfer failed: {e}", stage="kv_recv")
    pieces = Pieces(received)
    views = []
    with pieces.phases.measure("deserialize"):
        for r in received:
            views += r.layers if r.layers is not None else unpack(r.buffer, r.layout)
    engine = worker.engine
    layout = received[0].layout
    if needs_convert(layout, engine.kv_dtype, engine.kv_scales):
        with pieces.phases.measure("convert"):
            views = convert(views, dataclasses.replace(layout, num_layers=len(views), scales=None), engine.kv_dtype,
                            engine.kv_scales)
    worker.admit(rid, msg, pieces, views, layout.num_tokens)

