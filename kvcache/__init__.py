"""KV that outlives the GPU pool: the tiers below a worker's paged pool.

The engine's pool (``engine.kv_pool``) holds the blocks in use and, in its prefix cache, full blocks nobody uses
until they are evicted. Tiers keep the evicted ones (``tiers``, their copies in batches: ``copies``): ``HostTier``
in (pinned) host memory and, under it, ``DiskTier`` in a file; beside them a cluster-wide pool (``pool``, on a
store of ``stores``) holds what any worker computed. One prefix index covers them all: a prompt's keys are matched
in the GPU pool first, then the blocks that follow in the tiers and then the cluster pool, which are loaded into
new GPU blocks before the step that reads them. This package knows tensors and block keys, not models: the engine
hands it the pool's memory and calls it from its block manager and scheduler."""
from .attach import Tiers, attach
from .pool import PoolTier
from .tiers import DiskTier, HostTier, LoadTime, Tier, TierStats, host_capacity_blocks, load, phases, pin

__all__ = ["DiskTier", "HostTier", "LoadTime", "PoolTier", "Tier", "Tiers", "TierStats", "attach",
           "host_capacity_blocks", "load", "phases", "pin"]
