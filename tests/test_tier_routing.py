"""Where each prefix lives, as the router learns it: a worker reports the prefix-cache keys its GPU pool evicted
into a tier below (``demoted``) apart from those it dropped, its snapshot for a new router names both, and
``kv_aware`` counts a block held below the GPU pool at ``LOWER_TIER_VALUE`` of one held in it."""
import types

import torch

from engine.blocks import BlockManager
from kvcache import HostTier
from router.policy import LOWER_TIER_VALUE, KVAware, cached_blocks
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
    assert blocks.drain_events() == ([], []) and blocks.drain_demoted() == [12, 13]
    assert sorted(blocks.lower_keys()) == [12, 13]
    blocks.grow([], 4)  # two more: the tier (two slots) drops the first two it held
    assert blocks.drain_events() == ([], [12, 13]) and blocks.drain_demoted() == [10, 11]
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
