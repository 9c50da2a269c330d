"""Where each prefix lives, as the router learns it: a worker reports the prefix-cache keys its GPU pool evicted
into a tier below (``demoted``) apart from those it dropped, its snapshot for a new router names both, and
``kv_aware`` counts a block held below the GPU pool at ``LOWER_TIER_VALUE`` of one held in it, and one passed down
to disk (``sunk``) at what reading it saves against computing it, as the worker measured both. Keys put in the
cluster-wide pool (``pooled``) count for every worker at what fetching them saves against computing them, as the
workers measured both; the router remembers as many as the pool holds."""
import time
import types

import numpy as np
import torch

from engine.blocks import BlockManager
from kvcache import DiskTier, HostTier, PoolTier
from router.policy import LOWER_TIER_VALUE, POOL_VALUE_UNMEASURED, KVAware, cached_blocks, disk_value, pool_value
from router.prompts import PromptKeys
from router.workers import WorkerClient


def test_a_block_the_pool_evicts_into_the_host_tier_is_reported_demoted_not_evicted():
    blocks = BlockManager(4, 2, caching=True)
    tier = HostTier(torch.zeros(2, 4, 2, 1, 1), 2, on_drop=blocks.dropped_below)
    blocks.lower = tier
    table = []
    blocks.grow(table, 8)
    for i, block in enumerate(table):
        blocks.register(block, 10 + i)
    blocks.release(table)
    assert blocks.drain_events() == ([10, 11, 12, 13], [])
    blocks.grow([], 4)  # two cached blocks go to the tier
    assert blocks.drain_events() == ([], []) and blocks.drain_demoted() == ([12, 13], [])
    assert sorted(blocks.lower_keys()) == [12, 13]
    blocks.grow([], 4)  # two more: the tier (two slots) drops the first two it held
    assert blocks.drain_events() == ([], [12, 13]) and blocks.drain_demoted() == ([10, 11], [])
    assert sorted(blocks.lower_keys()) == [10, 11]


def worker(block_size=4):
    w = WorkerClient("tcp://127.0.0.1:1", "colocated", {})
    w.info = {"kv_block_size": block_size, "model": "m"}
    return w


def test_the_router_applies_stored_then_demoted_then_evicted_and_a_reset_names_both():
    w = worker()
    w._on_kv_events({"stored": [1, 2, 3]})
    w._on_kv_events({"stored": [4], "demoted": [2, 3], "evicted": [3]})
    assert w.kv_keys == {1, 2, 4} and w.kv_lower == {2}
    w._on_kv_events({"stored": [2]})  # loaded back into the GPU pool
    assert w.kv_lower == set()
    w._on_kv_events({"reset": True, "stored": [5, 6], "demoted": [6]})
    assert w.kv_keys == {5, 6} and w.kv_lower == {6}
    w._on_kv_events({"stored": "bad"})  # ignored
    assert w.kv_keys == {5, 6}


def test_kv_aware_prefers_a_prefix_in_gpu_memory_to_the_same_in_host_memory_and_that_to_none():
    prompt = PromptKeys(list(range(33)))
    keys = prompt.keys(4, "m")
    gpu, host, none = worker(), worker(), worker()
    gpu._on_kv_events({"stored": keys})
    host._on_kv_events({"stored": keys, "demoted": keys})
    assert cached_blocks(gpu, prompt, LOWER_TIER_VALUE) == 8 and cached_blocks(host, prompt) == 8
    assert abs(cached_blocks(host, prompt, LOWER_TIER_VALUE) - 8 * LOWER_TIER_VALUE) < 1e-9
    policy = KVAware()
    assert policy.pick([host, gpu, none], prompt) is gpu
    assert policy.pick([none, host], prompt) is host
    gpu.outstanding = 1  # at a little more load the host tier's copy wins: a tenth of the work, and free
    assert policy.pick([gpu, host], prompt) is host


class MemoryStore:
    """A store in this process's memory (``kvcache.stores``' calls)."""

    def __init__(self):
        self.blocks = {}

    def put(self, name, data):
        self.blocks[name] = np.array(data, copy=True)

    def exists(self, names):
        return [n in self.blocks for n in names]

    def get(self, names):
        return [self.blocks.get(n) for n in names]


def test_a_worker_reports_the_keys_it_put_in_the_pool_remembers_as_many_as_the_pool_holds_and_times_fetches():
    pool = torch.arange(2 * 6 * 2 * 1 * 1, dtype=torch.float32).view(2, 6, 2, 1, 1)
    tier = PoolTier(pool, MemoryStore(), "m", capacity=3)
    blocks = BlockManager(6, 2, caching=True)
    blocks.remote = tier
    for key, block in ((10, 0), (11, 1), (12, 2), (13, 3)):
        tier.publish(key, block)
    end = time.monotonic() + 10
    while tier.stats.published < 4 and time.monotonic() < end:
        time.sleep(0.01)
    assert blocks.drain_pooled() == [10, 11, 12, 13] and blocks.drain_pooled() == []
    assert blocks.pooled_keys() == [11, 12, 13]  # the last 3: what a pool of 3 blocks can still hold
    assert len(tier.match([10, 11, 99])) == 2 and tier.info()["pool_capacity_blocks"] == 3
    assert tier.info()["pool_fetch_ms_per_block"] > 0 and tier.stats.fetched == 2


def test_the_router_keeps_pooled_keys_through_a_reset_bounded_by_the_pool():
    w = worker()
    w.info["pool_capacity_blocks"] = 3
    w._on_kv_events({"stored": [1], "pooled": [1, 2]})
    w._on_kv_events({"reset": True, "stored": [], "pooled": [3]})  # the worker restarted: the store kept them
    assert list(w.kv_pooled) == [1, 2, 3] and w.kv_keys == set()
    w._on_kv_events({"pooled": [4, 2]})
    assert list(w.kv_pooled) == [3, 4, 2]


def measured(w, prompt_ms_per_token, fetch_ms=None):
    w.info["step_times"] = {"prompt_ms_per_token": prompt_ms_per_token}
    if fetch_ms is not None:
        w.info["pool_fetch_ms_per_block"] = fetch_ms
    return w


def test_kv_aware_weighs_a_prefix_in_the_pool_by_what_fetching_it_saves_against_computing_it():
    prompt = PromptKeys(list(range(33)))
    keys = prompt.keys(4, "m")
    holder, idle = measured(worker(), 1.0), measured(worker(), 1.0)  # 4 ms to compute a block of 4 tokens
    holder._on_kv_events({"stored": keys, "pooled": keys})
    assert pool_value(idle, None) == POOL_VALUE_UNMEASURED
    holder.outstanding = 1
    policy = KVAware()
    assert policy.pick([holder, idle], prompt) is holder  # the pool is not known for its fetches yet: 0.5 a block
    holder.info["pool_fetch_ms_per_block"] = 0.4  # a tenth of computing it
    assert abs(pool_value(idle, 0.4) - 0.9) < 1e-9
    assert abs(cached_blocks(idle, prompt, 1, lambda k: k in holder.kv_pooled, 0.9) - 8 * 0.9) < 1e-9
    assert policy.pick([holder, idle], prompt) is idle  # the idle worker fetches it: a tenth of the work, no wait
    holder.info["pool_fetch_ms_per_block"] = 5.0  # slower than computing it: the pool is worth nothing
    assert pool_value(idle, 5.0) == 0
    assert policy.pick([holder, idle], prompt) is holder


def test_blocks_the_host_tier_passes_down_to_disk_are_reported_sunk_and_weighed_by_their_measured_reads(tmp_path):
    blocks = BlockManager(4, 2, caching=True)
    pool = torch.arange(2 * 4 * 2 * 1 * 1, dtype=torch.float32).view(2, 4, 2, 1, 1)
    disk = DiskTier(pool, 8, str(tmp_path), on_drop=blocks.dropped_below)
    host = HostTier(pool, 2, on_drop=blocks.dropped_below, lower=disk)
    host.on_sink, blocks.lower = blocks.sunk_below, host
    table = []
    blocks.grow(table, 8)
    for i, block in enumerate(table):
        blocks.register(block, 10 + i)
    blocks.release(table)
    blocks.grow([], 8)  # all four leave the pool, the tail first: the head stays in host memory, the tail on disk
    stored, evicted = blocks.drain_events()
    demoted, sunk = blocks.drain_demoted()
    assert evicted == [] and demoted == [10, 11, 12, 13] and sunk == [12, 13]
    assert sorted(blocks.disk_keys()) == [12, 13] and sorted(blocks.lower_keys()) == [10, 11, 12, 13]
    w = worker(block_size=2)
    w._on_kv_events({"reset": True, "stored": [10, 11, 12, 13], "demoted": [10, 11, 12, 13], "sunk": [12, 13]})
    assert w.kv_disk == {12, 13} and w.kv_lower == {10, 11, 12, 13}
    w._on_kv_events({"stored": [12], "demoted": [10], "sunk": [10, 99], "evicted": [13]})
    assert w.kv_disk == {10} and w.kv_lower == {10, 11} and 99 not in w.kv_keys
    assert disk_value(w) == LOWER_TIER_VALUE  # no read measured yet
    measured(w, 1.0)  # 2 ms to compute a block of 2 tokens
    w.info["disk_read_ms_per_block"] = 4.0  # slower than computing it
    assert disk_value(w) == 0
    handles = disk.match([12, 13])  # reads from disk are timed, and reported
    for handle in handles:
        disk.pin_one(handle[1])
    disk.load_many([(slot, b) for (_, slot), b in zip(handles, (0, 1))])
    assert disk.info()["disk_read_ms_per_block"] > 0
