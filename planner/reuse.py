"""How many prompt tokens a KV cache of a given size could take from earlier requests of a trace.

Requests are taken in arrival order. A prompt's whole blocks are looked up in the cache from its first: the run of
blocks found before the first miss is its reusable prefix (a block after a miss is computed anyway: its keys depend
on the tokens before it). As an engine does, the prompt's last token is always computed, and a partial last block is
never cached. Its whole blocks then enter the cache (the hits become the most recently used). ``capacity`` None is
an unlimited cache, the window's ideal reuse; a number of blocks is an LRU over blocks of that size, the reuse one
pool of that capacity keeps (``pdserve bench replay`` sets it to the cluster's KV blocks)."""
from __future__ import annotations

from collections import OrderedDict


def reused_tokens(requests, block_size: int, capacity: int | None = None) -> list[int]:
    """Per request of ``requests`` (``planner.traces.TraceRequest``): the prompt tokens a cache of ``capacity``
    blocks of ``block_size`` tokens (None: unlimited) gives it."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for req in requests:
        whole = list(req.blocks[:req.prompt_tokens // block_size])
        hits = 0
        for block in whole:
            if block not in cache:
                break
            hits += 1
        out.append(min(hits * block_size, req.prompt_tokens - 1))
        for block in whole:
            cache[block] = None
            cache.move_to_end(block)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return out


def share(requests, reused: list[int]) -> float:
    """The fraction of all prompt tokens that ``reused`` took from the cache."""
    total = sum(r.prompt_tokens for r in requests)
    return sum(reused) / total if total else 0.0
