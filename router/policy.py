"""Worker selection policies. ``pick(workers, prompt)`` gets the request's
``PromptKeys`` (or None); only ``kv_aware`` looks at it."""
from __future__ import annotations

import itertools


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, workers, prompt=None):
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding:
    def __init__(self):
        self._tie = itertools.count()

    def pick(self, workers, prompt=None):
        low = min(w.outstanding for w in workers)
        tied = [w for w in workers if w.outstanding == low]
        return tied[next(self._tie) % len(tied)]


# What a prompt block held in a tier below the GPU pool is worth against one in the pool: loading it costs about a
# tenth of computing it (one H200, Llama-3.1-8B shape: 16k tokens loaded from host memory in 48 ms, computed in
# 550 ms; bench/RESULTS.md, KV tiers).
LOWER_TIER_VALUE = 0.9


# What a prompt block in the cluster-wide pool is worth before any worker has measured a fetch from it (a fetch over
# TCP from Mooncake Store's daemon, 2.7-3.0 GB/s on the CPU, against an 8B model's prefill on an H200, about 3.6 GB/s
# of KV: the two are close, and the value is measured as soon as a worker fetched; bench/RESULTS.md, KV tiers).
POOL_VALUE_UNMEASURED = 0.5


def cached_blocks(worker, prompt, lower_value: float = 1, pooled=None, pool_value: float = 0,
                  disk_value: float | None = None) -> float:
    """How many leading blocks of the prompt ``worker`` reported holding (0 without an index or keys); those held
    only in a tier below its GPU pool count ``lower_value`` each (those on disk ``disk_value``, where given); after
    them, blocks that ``pooled(key)`` says the cluster-wide pool holds count ``pool_value`` each."""
    if prompt is None:
        return 0
    keys = prompt.keys(int(worker.info.get("kv_block_size") or 0), str(worker.info.get("model") or ""))
    held, lower, disk = worker.kv_keys, getattr(worker, "kv_lower", ()), getattr(worker, "kv_disk", ())
    n = 0
    for key in keys:
        if key in held:
            if key not in lower:
                n += 1
            else:
                n += disk_value if disk_value is not None and key in disk else lower_value
        elif pooled is not None and pooled(key):
            n += pool_value
        else:
            break
    return n


def pool_fetch_ms(workers) -> float | None:
    """The time a block takes to come from the cluster-wide pool, as the workers measured it (their mean)."""
    seen = [float(w.info["pool_fetch_ms_per_block"]) for w in workers if w.info.get("pool_fetch_ms_per_block")]
    return sum(seen) / len(seen) if seen else None


def pool_value(worker, fetch_ms: float | None, unmeasured: float = POOL_VALUE_UNMEASURED) -> float:
    """What a block fetched from the pool (or read from disk) in ``fetch_ms`` saves ``worker`` against computing it:
    1 - the fetch time over the worker's measured prompt time for a block's tokens (0 where fetching is no
    faster); ``unmeasured`` where either time is not known yet."""
    per_token, size = worker.prompt_ms_per_token(), int(worker.info.get("kv_block_size") or 0)
    if fetch_ms is None or not per_token or not size:
        return unmeasured
    return max(0.0, 1.0 - fetch_ms / (per_token * size))


def disk_value(worker) -> float:
    """What a block on the worker's disk tier saves against computing it, by its measured read time a block (before
    any read: a host tier's ``LOWER_TIER_VALUE``; a single disk at 2 GB/s is slower than an H200 computes an 8B
    model's KV, docs/kv-tiers.md)."""
    read = worker.info.get("disk_read_ms_per_block")
    return pool_value(worker, float(read) if read else None, LOWER_TIER_VALUE)


class KVAware:
    """The worker holding the longest cached prefix of the prompt, balanced against load: score = cached share of
    the prompt - ``weight`` x outstanding / (1 + most outstanding), where a block held in a tier below a worker's
    GPU pool counts ``LOWER_TIER_VALUE`` (on disk: what reading it saves, ``disk_value``), and one in the
    cluster-wide pool (any worker put it there) what fetching it saves that worker against computing it
    (``pool_value``); ties go to the least loaded."""

    def __init__(self, weight: float = 0.5):
        self.weight = weight
        self._tie = itertools.count()

    def pick(self, workers, prompt=None):
        if prompt is None or not prompt.ids:
            return LeastOutstanding.pick(self, workers)
        most = max(w.outstanding for w in workers)
        total = len(prompt.ids)

        pooled, fetch_ms = None, None
        if any(getattr(w, "kv_pooled", None) for w in workers):
            pooled, fetch_ms = (lambda key: any(key in w.kv_pooled for w in workers)), pool_fetch_ms(workers)
        scores = [cached_blocks(w, prompt, LOWER_TIER_VALUE, pooled, pool_value(w, fetch_ms) if pooled else 0,
                                disk_value(w) if getattr(w, "kv_disk", None) else None)
                  * int(w.info.get("kv_block_size") or 0) / total
                  - self.weight * w.outstanding / (1 + most) for w in workers]
        best = max(scores)
        return LeastOutstanding.pick(self, [w for w, s in zip(workers, scores) if s >= best - 1e-9])


def prompt_first(prefill_workers, decode_workers) -> set:
    """The decode workers to leave out of a disaggregated request's decode pick while another has room: the twin
    (a mixed worker is a client in both groups) of the one prefill worker with the fewest prompts in flight, where
    one has strictly fewest. The prefill pick comes after the decode pick and cannot use the decode worker itself, so
    without this the decode pick would choose where prompts go by accident: with two mixed workers, one slow at
    prompts decodes for longer, the least loaded decode pick goes to the other, and every prompt to the slow one."""
    loads = sorted(w.outstanding for w in prefill_workers)
    if len(loads) < 2 or loads[0] == loads[1]:
        return set()
    least = next(w for w in prefill_workers if w.outstanding == loads[0])
    return {d for d in decode_workers if d.address == least.address}


POLICIES = {"round_robin": RoundRobin, "least_outstanding": LeastOutstanding, "kv_aware": KVAware}


def make_policy(name: str, kv_weight: float = 0.5):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(kv_weight) if cls is KVAware else cls()
