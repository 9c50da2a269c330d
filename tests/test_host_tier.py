"""The host-memory KV tier (``kvcache.HostTier``, ``--kv-host-bytes``) on the CPU with the tiny model: blocks the
pool evicts come back on a prefix hit with the same greedy text; a block still being written is never read; a slot
about to be loaded from is never dropped; bad sizes are refused at start; and a replayed trace slice reuses what an
LRU of the pool and the tier together keeps, and, replayed again, nearly all of it."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.sequence import Sequence
import kvcache
from kvcache import HostTier, host_capacity_blocks

SLICE = Path(__file__).with_name("data") / "traces" / "mooncake_conversation_slice.jsonl"


def generate(engine, prompt, n=8):
    seq = Sequence.create(f"r{random.random()}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                          engine.tokenizer, engine.max_len)
    engine.add(seq)
    while engine.has_work:
        engine.step()
    return seq


def test_a_prefix_the_pool_evicted_comes_back_from_host_memory_with_the_same_text():
    block = Engine(EngineConfig(device="cpu", threads=1, num_blocks=8, warmup=False)).block_bytes
    engine = Engine(EngineConfig(device="cpu", threads=1, num_blocks=40, kv_host_bytes=200 * block, warmup=False))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    cold = generate(engine, prompt)
    for _ in range(6):  # 1,800 other tokens through a pool of 640: the prompt's blocks leave it
        generate(engine, [rng.randrange(3, 250) for _ in range(300)])
    assert not engine.blocks.match(engine.scheduler.keys(cold, 32))
    warm = generate(engine, prompt)
    assert warm.output_ids == cold.output_ids
    assert warm.cached_by_tier == {"gpu": 0, "host": 288} and warm.cached_tokens == 288  # 18 whole blocks
    info = engine.prefix_info()
    assert info["prefix_host_cached_tokens"] == 288 and info["host_loaded"] == 18 and info["host_offloaded"] >= 18
    assert engine.blocks.num_free == engine.num_blocks  # nothing left taken


class Pending:
    """A copy into host memory still in flight (what a CUDA event reports before the copy ends)."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_a_block_still_being_written_is_never_read_and_counted():
    pool = torch.arange(2 * 3 * 4 * 2 * 2, dtype=torch.float32).view(2, 3, 4, 2, 2)
    tier = HostTier(pool, 4)
    for key, block in ((10, 0), (11, 1), (12, 2)):
        tier.offload(key, block)
    copy = Pending()
    tier.writing[tier.slot_of[11]] = copy
    assert tier.match([10, 11, 12]) == [(tier, tier.slot_of[10])] and tier.stats.skipped_in_flight == 1
    copy.done = True
    assert tier.match([10, 11, 12]) == [(tier, tier.slot_of[k]) for k in (10, 11, 12)] and not tier.writing
    assert torch.equal(tier.slots[tier.slot_of[12]], pool[:, 2])


def test_a_slot_about_to_be_loaded_from_is_never_dropped():
    pool = torch.zeros(2, 8, 4, 1, 1)
    dropped = []
    tier = HostTier(pool, 2, on_drop=dropped.append)
    tier.offload(1, 0)
    tier.offload(2, 1)
    kvcache.pin([(tier, tier.slot_of[1])])  # matched by a sequence admitted this step
    assert tier.offload(3, 2) and dropped == [2]  # the unpinned, though more recent
    kvcache.pin([(tier, tier.slot_of[3])])
    assert not tier.offload(4, 3) and 4 not in tier.slot_of  # every slot pinned: not kept
    kvcache.load([((tier, tier.slot_of[1]), 5), ((tier, tier.slot_of[3]), 6)])
    assert not tier.pinned and tier.offload(4, 3)


def test_a_block_loaded_back_into_the_pool_is_dropped_first_and_not_passed_down():
    pool = torch.arange(2 * 8 * 4, dtype=torch.float32).view(2, 8, 4, 1, 1)
    lower, dropped = HostTier(pool, 4), []
    tier = HostTier(pool, 3, on_drop=dropped.append, lower=lower)
    for key, block in ((1, 0), (2, 1), (3, 2)):
        tier.offload(key, block)
    handles = tier.match([3])
    kvcache.pin(handles)
    kvcache.load([(handles[0], 5)])  # key 3 is in the pool again: its host copy goes first
    tier.offload(4, 3)
    assert 3 not in tier.slot_of and dropped == [3] and 3 not in lower.slot_of
    tier.offload(5, 4)  # then the least recently used, passed down
    assert 1 not in tier.slot_of and 1 in lower.slot_of and dropped == [3]
    handles = tier.match([2])
    kvcache.pin(handles)
    kvcache.load([(handles[0], 6)])
    tier.offload(2, 6)  # the pool evicts it again: held already, now the most recent use
    tier.offload(6, 7)
    assert 2 in tier.slot_of and 4 not in tier.slot_of and 4 in lower.slot_of


def test_idle_blocks_next_to_be_evicted_are_written_ahead_and_their_eviction_copies_nothing():
    from engine.blocks import BlockManager
    from kvcache.attach import AHEAD_TOKENS, Tiers

    bs = AHEAD_TOKENS // 4  # room for four blocks kept free or written ahead (AHEAD_TOKENS; a quarter is eight)
    pool = torch.randn(2, 32, bs, 1, 1)
    blocks = BlockManager(32, bs, caching=True)
    tier = HostTier(pool, 16, on_drop=blocks.dropped_below)
    blocks.lower, tiers = tier, Tiers(tier, None, blocks)
    table = []
    blocks.grow(table, 30 * bs)  # 30 of 32 taken, cached, let go: two free, 30 idle
    for i, block in enumerate(table):
        blocks.register(block, 100 + i)
    order = list(reversed(table))  # released last first: the tail is evicted first
    blocks.release(table)
    assert tiers.write_ahead() == 2 and set(tier.slot_of) == {blocks.key_of[b] for b in order[:2]}
    assert tiers.write_ahead() == 0 and tier.stats.written_ahead == 2  # held already
    blocks.grow([], 4 * bs)  # two free, then the two idle blocks written ahead
    assert tier.stats.offloaded == 2 and not blocks.evicted  # their eviction copied nothing
    assert tiers.write_ahead() == 4  # no block free now: four more
    key, block = blocks.key_of[order[2]], order[2]
    assert torch.equal(tier.slots[tier.slot_of[key]], pool[:, block])
    blocks.take([block])  # a prefix hit on it: its copy here is held twice, the first to go
    assert next(iter(tier.slot_of)) == key and key in tier.above


def test_a_batch_of_evictions_larger_than_the_tier_passes_the_right_bytes_down():
    pool = torch.randn(2, 8, 4, 1, 1)
    lower = HostTier(pool, 8)
    tier = HostTier(pool, 3, lower=lower)
    assert tier.offload_many([(10 + b, b) for b in range(7)]) == set(range(10, 17))
    assert set(tier.slot_of) == {14, 15, 16} and set(lower.slot_of) == {10, 11, 12, 13}
    for b in range(7):
        held = tier if 10 + b in tier.slot_of else lower
        assert torch.equal(held.slots[held.slot_of[10 + b]], pool[:, b])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tier's streams, events and pinned copies need a GPU")
def test_on_a_gpu_evictions_writes_ahead_and_loads_are_bit_exact():
    pool = torch.randn(8, 64, 16, 2, 32, device="cuda").to(torch.bfloat16)
    lower = HostTier(pool, 64)
    tier = HostTier(pool, 24, lower=lower)
    assert tier.slots.is_pinned()
    original = pool.clone()
    assert tier.write_ahead([(100 + b, b) for b in range(0, 16)]) == 16
    kept = tier.offload_many([(100 + b, b) for b in range(8, 48)])  # 8 held already, 32 new: past the tier's size
    assert kept == set(range(108, 148))
    assert set(tier.slot_of) == set(range(124, 148)) and set(lower.slot_of) == set(range(100, 124))
    pool.zero_()  # the blocks handed out again and overwritten (queued after the copies out)
    handles = tier.match(list(range(124, 148))) + lower.match(list(range(100, 124)))
    assert len(handles) == 48
    kvcache.pin(handles)
    keys = list(range(124, 148)) + list(range(100, 124))
    targets = [(k * 7) % 64 for k in range(48)]  # distinct blocks, out of order
    kvcache.load(list(zip(handles, targets)))
    torch.cuda.synchronize()
    assert all(torch.equal(pool[:, t], original[:, k - 100]) for t, k in zip(targets, keys))


def test_bad_sizes_are_refused_with_a_clear_error():
    for size in (0, -5):
        with pytest.raises(ValueError, match="positive"):
            host_capacity_blocks(size, 1024)
    with pytest.raises(ValueError, match="more than this machine"):
        host_capacity_blocks(1 << 60, 1024)
    with pytest.raises(ValueError, match="holds no KV block"):
        host_capacity_blocks(100, 1024)
    with pytest.raises(ValueError, match="kv_host_bytes"):
        EngineConfig(kv_host_bytes=-1)
    out = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--colocated", "--kv-host-bytes", "1000000T"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "more than this machine" in out.stderr


def replay_twice(tmp_path, pool_blocks: int, host_blocks: int, concurrency: int) -> tuple[dict, dict]:
    """``bench replay`` of the slice at 16 tokens a block, twice over the same prompts, on a colocated worker with a
    pool and a host tier of these many blocks: the two runs' reports."""
    block = Engine(EngineConfig(device="cpu", threads=1, num_blocks=8, warmup=False)).block_bytes
    out = tmp_path / "out"
    up = f"--colocated --no-warmup --kv-budget {pool_blocks * block} --kv-host-bytes {host_blocks * block}"
    proc = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "bench", "replay", str(SLICE),
                           "--up-args", up, "--block-size", "16", "--concurrency", str(concurrency),
                           "--speeds", "1000,1000", "--same-prompts", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    first, again = json.loads((out / "replay.json").read_text())["runs"]
    assert first["summary"]["errors"] == again["summary"]["errors"] == 0
    return first, again


def test_a_replayed_slice_reuses_what_the_pool_and_the_tier_keep_and_again_nearly_all(tmp_path):
    """The conversation slice at 16 tokens a block (189 requests that fit the tiny model, 2,720 distinct blocks):
    a pool of 80 blocks and a host tier of 3,000. The first pass reuses at least 95% of what an LRU of 3,080 blocks
    keeps; the same prompts again reuse at least 90% of their prompt tokens (every whole block is held)."""
    first, again = replay_twice(tmp_path, 80, 3000, concurrency=1)
    assert first["reuse"]["lru_capacity_blocks"] == 3080
    assert first["reuse"]["workers"]["reused_tokens"] >= 0.95 * first["reuse"]["lru"]["reused_tokens"], first["reuse"]
    assert again["reuse"]["workers"]["share"] >= 0.90, again["reuse"]
    assert again["reuse"]["lru"]["share"] >= 0.90  # the models keep the first run's blocks, as the workers do
    assert again["reuse"]["workers"]["reused_tokens"] >= 0.95 * again["reuse"]["lru"]["reused_tokens"], again["reuse"]


def test_a_window_a_little_larger_than_the_host_tier_is_held_by_the_pool_and_the_tier_together(tmp_path):
    """The slice at concurrency 16 with a host tier of 91% of its 2,720 distinct blocks and a pool of 620 (the GPU
    bar's proportions: 64 and 16 GiB against a 70 GiB window): the second pass reuses at least 90% of its prompt
    tokens. (With the pool's copies held in the tier too, as the most recent uses, it reused 68%.)"""
    _, again = replay_twice(tmp_path, 620, 2475, concurrency=16)
    assert again["reuse"]["workers"]["share"] >= 0.90, again["reuse"]


def test_blocks_the_host_tier_drops_go_to_disk_come_back_and_a_corrupt_one_is_recomputed(tmp_path):
    """A host tier of 10 blocks over a disk tier of 200: a prompt pushed out of both the pool and host memory comes
    back from the disk file with the same text; a block whose bytes changed on disk fails its checksum and the
    prompt's blocks from there on are computed again, with the same text; the file goes with the engine."""
    import gc

    block = Engine(EngineConfig(device="cpu", threads=1, num_blocks=8, warmup=False)).block_bytes
    engine = Engine(EngineConfig(device="cpu", threads=1, num_blocks=40, kv_host_bytes=10 * block, warmup=False,
                                 kv_disk=str(tmp_path), kv_disk_bytes=200 * block))
    rng = random.Random(1)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    cold = generate(engine, prompt)
    for _ in range(6):
        generate(engine, [rng.randrange(3, 250) for _ in range(300)])
    warm = generate(engine, prompt)
    assert warm.output_ids == cold.output_ids and warm.cached_by_tier.get("disk", 0) > 0
    assert warm.cached_tokens == 288
    disk = engine.tiers.host.lower
    for _ in range(6):  # out of the pool and host memory again
        generate(engine, [rng.randrange(3, 250) for _ in range(300)])
    first = engine.scheduler.keys(warm, 16)[0]
    disk.slots[disk.slot_of[first]].view(torch.uint8)[0] ^= 0xFF  # one byte of the prompt's first block, on disk
    again = generate(engine, prompt)
    assert again.output_ids == cold.output_ids and disk.stats.corrupt == 1
    assert again.cached_tokens == 0 and first not in disk.slot_of  # nothing before the bad block to take
    info = engine.prefix_info()
    assert info["disk_corrupt"] == 1 and info["prefix_disk_cached_tokens"] == warm.cached_by_tier["disk"]
    assert engine.blocks.num_free == engine.num_blocks
    path = disk.path
    assert Path(path).exists()
    del engine, disk
    gc.collect()
    assert not Path(path).exists()
