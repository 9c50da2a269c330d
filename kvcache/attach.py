"""The tiers of one engine, attached to its block manager as its options ask (``attach``), and what the engine
calls on them: ``settle`` (before a block handed to another thread is written), ``end_step`` (after a step's
loads, before its forward), ``count`` (a sequence's cached tokens by tier), ``info`` (the worker's report).

``end_step`` also writes ahead: the idle blocks next in line to be evicted (after the free ones), up to
``AHEAD_TOKENS`` or a quarter of the pool, are copied into the host tier (on a GPU on its own stream while the
step computes), so that a prompt that evicts them waits for no copy. (Copied at eviction, 1-2 GB of blocks put
40-70 ms of copies in front of the prompt that needed the room, on an H200.)"""
from __future__ import annotations

import itertools
import os
import shutil

import torch

from .mirror import MirrorTier
from .pool import PoolTier, namespace
from .disk import DiskTier
from .tiers import HostTier, capacity_blocks, host_capacity_blocks

AHEAD_TOKENS = 32768  # free or written-ahead room kept in the pool (two 16k-token prompts loaded at once)


class Tiers:
    def __init__(self, host: HostTier | None = None, pool: PoolTier | None = None, blocks=None,
                 mirror: MirrorTier | None = None):
        """``mirror``: (another rank of a group or pipeline) the copies of rank 0's host tier, on this rank's KV."""
        self.host, self.pool, self.blocks, self.mirror = host, pool, blocks, mirror
        self.seen_changes = -1  # the block manager's ``changes`` at the last write-ahead
        self.tokens = {"host": 0, "disk": 0, "pool": 0}  # prompt tokens loaded from each

    def settle(self) -> None:
        if self.host is not None:
            self.host.settle()

    def end_step(self) -> None:
        if self.pool is not None:
            self.pool.end_step()
        if self.host is not None:
            self.write_ahead()

    def write_ahead(self) -> int:
        blocks = self.blocks
        with blocks.lock:
            if blocks.changes == self.seen_changes:  # nothing freed, taken or evicted since the last look
                return 0
            self.seen_changes = blocks.changes
            want = min(AHEAD_TOKENS // blocks.block_size, blocks.num_blocks // 4) - len(blocks.free)
            if want <= 0:
                return 0
            pairs = [(blocks.key_of[b], b) for b in itertools.islice(blocks.idle, want)]
        return self.host.write_ahead(pairs)

    def count(self, by_tier: dict) -> None:
        for tier in self.tokens:
            self.tokens[tier] += by_tier.get(tier, 0)

    def info(self) -> dict:
        return {**{f"prefix_{t}_cached_tokens": n for t, n in self.tokens.items()},
                **(self.host.info() if self.host is not None else {}),
                **(self.pool.info() if self.pool is not None else {})}


def attach(pool: torch.Tensor, blocks, block_bytes: int, options, model: str, echo=None,
           follower: bool = False) -> Tiers:
    """``options``: ``kv_host_bytes``, ``kv_disk`` and ``kv_disk_bytes``, ``kv_pool`` (an engine's config).
    A host tier under ``blocks`` (the pool's ``engine.blocks.BlockManager``), a disk tier under it, and a
    cluster-wide pool beside them, each where asked; clear errors for what cannot be. ``block_bytes``: a block of
    every rank (the sizes are the worker's, its ranks together). Several ranks (``kvcache.mirror``): rank 0 passes
    ``echo``, the others ``follower``, and they mirror its host tier."""
    host_bytes, disk = getattr(options, "kv_host_bytes", 0), getattr(options, "kv_disk", None)
    if disk and not host_bytes:
        raise ValueError("--kv-disk goes under a host tier: give --kv-host-bytes too")
    if follower:
        return Tiers(mirror=MirrorTier(pool, host_capacity_blocks(host_bytes, block_bytes)) if host_bytes else None)
    host = None
    if host_bytes:
        lower = None
        if disk:
            if not os.path.isdir(disk):
                raise ValueError(f"--kv-disk {disk}: no such directory")
            room = shutil.disk_usage(disk).free
            lower = DiskTier(pool, capacity_blocks(options.kv_disk_bytes, block_bytes, "--kv-disk-bytes (free on "
                                                   "disk)", room), disk, on_drop=blocks.dropped_below)
        host = HostTier(pool, host_capacity_blocks(host_bytes, block_bytes), on_drop=blocks.dropped_below,
                        lower=lower)
        host.on_sink = blocks.sunk_below
        host.echo = echo
        blocks.lower = host
    remote = None
    if getattr(options, "kv_pool", None):
        from .stores import open_store

        size = getattr(options, "kv_pool_bytes", 0)
        remote = PoolTier(pool, open_store(options.kv_pool), namespace(model, pool),
                          **({"capacity": max(1, size // block_bytes)} if size else {}))
        blocks.remote = remote
    return Tiers(host, remote, blocks)
