"""KV that outlives the GPU pool: the tiers below a worker's paged pool.

The engine's pool (``engine.kv_pool``) holds the blocks in use and, in its prefix cache, full blocks nobody uses
until they are evicted. A tier keeps the evicted ones: ``host_tier.HostTier`` in (pinned) host memory. One prefix
index covers both: a prompt's keys are matched in the pool first, then the blocks that follow in the tier, which
are loaded back into new pool blocks before the step that reads them. This package knows tensors and block keys,
not models: the engine hands it the pool's memory and calls it from its block manager and scheduler."""
from .host_tier import HostTier, TierStats, attach, host_capacity_blocks

__all__ = ["HostTier", "TierStats", "attach", "host_capacity_blocks"]
