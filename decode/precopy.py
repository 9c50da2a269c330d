"""The target's side of a pre-copied move (``router.migration``): the full blocks of a sequence that still decodes
on its source arrive first, as the transfer ``RID:pre``; they are taken into blocks of this worker's pool at once
and held for ``RID`` as a prefix hold is (``decode.holds``: let go at its deadline unless a ``decode`` for it waits
here). The ``decode`` that follows (``precopied``: how many tokens came before) waits until they are in; its own KV
then holds only the tokens after them, and the held blocks stand for the first ones (``holds.prefix``, which trusts
them without the prefix cache's keys: they are the sequence's own KV). ``self`` is the ``DecodeWorker``."""
from __future__ import annotations

import logging
import time

from kvtransfer import TransferError, TransferStatus
from kvtransfer.convert import convert, needs_convert
from kvtransfer.tensors import unpack

log = logging.getLogger(__name__)
SUFFIX = ":pre"


def arrived(self, tid: str) -> None:
    """(Engine thread, on the receiver's word) ``RID:pre`` is in: into blocks and held; then the ``decode`` waiting
    for it, if one is."""
    rid = tid.removesuffix(SUFFIX)
    if take(self, rid) and rid in self.waiting:
        self._try_start(rid)


def ready(self, rid: str, msg: dict) -> bool:
    """Whether a ``decode`` for ``rid`` may start: no blocks came before its KV, or they are held here now."""
    if not msg.get("precopied") or rid in self.precopied:
        return True
    return take(self, rid)


def take(self, rid: str) -> bool:
    """``RID:pre`` into blocks of the pool, held for ``rid``; False while it is not in (or where it failed: the
    ``decode`` then finds no blocks held and fails, and its source decodes on)."""
    tid = rid + SUFFIX
    if rid in self.precopied or self.receiver is None or self.receiver.poll(tid) != TransferStatus.DONE:
        return rid in self.precopied
    try:
        received = self.receiver.wait(tid, 0)
    except (TransferError, TimeoutError) as e:
        log.warning("the blocks sent ahead for %s did not arrive: %s", rid, e)
        return False
    table = _place(self, tid, received)
    received.release()
    if table is None:
        return False
    self.held[rid] = (table, time.monotonic() + self.kv_timeout)
    self.precopied.add(rid)
    return True


def _place(self, tid: str, received) -> list[int] | None:
    """The blocks now holding a received KV (landed in them, or copied in), or None with no blocks free."""
    if received.landed is not None:
        return self.landing.pop(tid, None)
    views = received.layers if received.layers is not None else unpack(received.buffer, received.layout)
    if needs_convert(received.layout, self.engine.kv_dtype, self.engine.kv_scales):
        views = convert(views, received.layout, self.engine.kv_dtype, self.engine.kv_scales)
        self.kv_converted += 1
    table = self.engine.reserve(received.layout.num_tokens)
    if table is None:
        log.warning("no blocks free for the %d tokens sent ahead of %s", received.layout.num_tokens, tid)
        return None
    self.engine.pool.scatter(table, views)
    return table


def forget(self, rid: str) -> None:
    """``rid``'s hold ended (used, released or timed out)."""
    self.precopied.discard(rid)
    if self.receiver is not None:
        self.receiver.abort(rid + SUFFIX)
