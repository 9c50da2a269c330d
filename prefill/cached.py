"""What a worker that computed a prompt tells the router about its KV cache: how many of the prompt's tokens it took
from the cache instead of computing them (``cached_tokens``: the response's ``usage.prompt_tokens_details``) and the
same split by the tier each came from (``cached_tokens_by_tier``: the response's ``pdserve`` block; ``{"gpu": N}``
unless the engine filled ``seq.cached_by_tier``, whose keys pass through as they are).

Prefill and mixed workers send it with ``first``; a decode (or colocated) worker with the ``first`` of a prompt it
computed and with that sequence's ``done`` (a prompt computed again sends no ``first``: a retry or a move that goes
on from a token its client has)."""
from __future__ import annotations


def prompt_cache(seq) -> dict:
    tiers = getattr(seq, "cached_by_tier", None) or {"gpu": seq.cached_tokens}
    return {"cached_tokens": min(seq.cached_tokens, len(seq.prompt_ids)), "cached_tokens_by_tier": dict(tiers)}
