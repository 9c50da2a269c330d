"""KV that outlives the GPU pool: the tiers below a worker's paged pool.

The engine's pool (``engine.kv_pool``) holds the blocks in use and, in its prefix cache, full blocks nobody uses
until they are evicted. Tiers keep the evicted ones (``tiers``): ``HostTier`` in (pinned) host memory and, under
it, ``DiskTier`` in a file. One prefix index covers them all: a prompt's keys are matched in the pool first, then
the blocks that follow in the tiers, which are loaded back into new pool blocks before the step that reads them. This package knows tensors and block keys,
not models: the engine hands it the pool's memory and calls it from its block manager and scheduler."""
from .tiers import DiskTier, HostTier, Tier, TierStats, attach, host_capacity_blocks

__all__ = ["DiskTier", "HostTier", "Tier", "TierStats", "attach", "host_capacity_blocks"]
