"""Prefix holds of a decode worker: the router asks it to keep the cached blocks of a prompt's longest cached prefix
(``hold``), so prefill sends only the KV after them; when the KV arrives, the held blocks stand for the prompt's first
tokens once checked against its own keys (``prefix``; blocks a move sent ahead, ``decode.precopy``, unchecked). ``self`` is the ``DecodeWorker``."""
from __future__ import annotations

import time

from engine.errors import RequestError


def hold(self, rid: str, keys) -> None:
    """Keep the cached blocks of the prompt's longest cached prefix (``keys``: its block keys as the router
    computed them) for ``rid``, whose KV will then come without them; answers ``held`` with their count."""
    if not isinstance(keys, list) or any(type(k) is not int for k in keys) or rid in self.held:
        return self.fail(rid, 400, "hold needs a list of block keys")
    table = self.engine.cached_prefix(keys[:self.engine.max_len // self.engine.block_size])
    self.held[rid] = (table, time.monotonic() + self.kv_timeout)
    self.emit(rid, "held", blocks=len(table))


def prefix(self, rid, seq, kv_tokens) -> list[int]:
    """The held blocks that stand for the first ``len(prompt) - kv_tokens`` tokens (checked against the prompt's
    own keys); the rest of the hold is let go. Raises RequestError when they do not cover them."""
    table, _ = self.held.pop(rid, ([], 0.0))
    skip = seq.num_tokens - 1 - kv_tokens  # the KV holds every token but the last
    bs = self.engine.block_size
    try:
        if skip < 0 or skip % bs or skip // bs > len(table):
            raise RequestError(f"{len(seq.prompt_ids)} prompt ids but KV for {kv_tokens} tokens and "
                               f"{len(table)} cached blocks held")
        keys = self.engine.scheduler.keys(seq, skip) if rid not in self.precopied else None  # (its own KV: trusted)
        if keys is not None and [self.engine.blocks.key_of[b] for b in table[:skip // bs]] != keys[:skip // bs]:
            raise RequestError("the held blocks do not hold this prompt's prefix")
    except RequestError:
        self.engine.release(table)
        raise
    finally:
        self.precopied.discard(rid)
    self.engine.release(table[skip // bs:])
    del table[skip // bs:]
    return table
