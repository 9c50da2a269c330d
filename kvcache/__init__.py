"""KV that outlives the GPU pool: the tiers below a worker's paged pool.

The engine's pool (``engine.kv_pool``) holds the blocks in use and, in its prefix cache, full blocks nobody uses
until they are evicted. Tiers keep the evicted ones (``tiers``, their copies in batches: ``copies``): ``HostTier``
in (pinned) host memory and, under it, ``DiskTier`` in a file (``disk``); beside them a cluster-wide pool (``pool``,
on a store of ``stores``) holds what any worker computed. One prefix index covers them all: a prompt's keys are
matched in the GPU pool first, then the blocks that follow in the tiers and then the cluster pool, which are loaded
into new GPU blocks before the step that reads them (``loads``). ``attach`` builds them for an engine; with several
ranks, the others repeat rank 0's host-tier copies (``mirror``). This package knows tensors and block keys, not
models: the engine hands it the pool's memory and calls it from its block manager and scheduler."""
from .attach import Tiers, attach
from .disk import DiskTier
from .loads import LoadTime, load, phases, pin
from .pool import PoolTier
from .tiers import HostTier, Tier, TierStats, host_capacity_blocks

__all__ = ["DiskTier", "HostTier", "LoadTime", "PoolTier", "Tier", "Tiers", "TierStats", "attach",
           "host_capacity_blocks", "load", "phases", "pin"]
