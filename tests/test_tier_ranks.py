"""The host tier under tensor and pipeline parallelism on the CPU (gloo; two rank or stage processes): rank 0 keeps
the tier and every other rank makes the same copies on its own slice of the KV (``kvcache.mirror``). A prefix the
pool evicted comes back from host memory with the greedy tokens and logprobs of a single engine that computed it;
the worker's host budget is split over its ranks; the disk tier and the cluster pool are refused with them."""
import random

import pytest

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from tests.test_paged_engine import GREEDY

BLOCKS, HOST_BLOCKS = 40, 200  # a pool of 640 tokens, a host tier of 3,200


def run(engine, prompt):
    return generate_many(engine, [prompt], [SamplingParams(max_tokens=8, **GREEDY)])[0][1]


def whole_block_bytes() -> int:
    return Engine(EngineConfig(device="cpu", threads=1, num_blocks=8, warmup=False, dtype="float32")).block_bytes


@pytest.mark.parametrize("ranks", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_a_prefix_evicted_under_several_ranks_comes_back_from_host_memory_with_the_same_tokens(ranks):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    others = [[rng.randrange(3, 250) for _ in range(300)] for _ in range(6)]  # 1,800 tokens through 640
    reference = run(Engine(EngineConfig(threads=1, warmup=False, dtype="float32", num_blocks=BLOCKS)), prompt)
    block = whole_block_bytes()
    engine = Engine(EngineConfig(threads=1, warmup=False, dtype="float32", num_blocks=BLOCKS,
                                 kv_host_bytes=HOST_BLOCKS * block, **ranks))
    try:
        assert engine.tiers.host.capacity == HOST_BLOCKS  # the worker's budget, over its ranks' slices
        assert engine.block_bytes * 2 == block
        cold = run(engine, prompt)
        for other in others:
            run(engine, other)
        assert not engine.blocks.match(engine.scheduler.keys(cold, 32))  # the pool let the prompt go
        warm = run(engine, prompt)
        info = engine.prefix_info()
    finally:
        engine.close()
    assert warm.cached_by_tier == {"gpu": 0, "host": 288}  # 18 whole blocks, loaded on every rank
    assert info["host_loaded"] == 18
    for seq in (cold, warm):  # the other rank's half of the KV came back too: the same logits as one engine
        assert seq.output_ids == reference.output_ids
        assert [e[1] for e in seq.pending_logprobs] == pytest.approx([e[1] for e in reference.pending_logprobs],
                                                                     abs=1e-4)


def test_the_disk_tier_and_the_cluster_pool_are_refused_with_several_ranks(tmp_path):
    for ranks in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(ValueError, match="without --tp/--pp"):
            EngineConfig(kv_host_bytes=1 << 20, kv_disk=str(tmp_path), kv_disk_bytes=1 << 20, **ranks)
        with pytest.raises(ValueError, match="without --tp/--pp"):
            EngineConfig(kv_pool="mooncake://127.0.0.1:50051", **ranks)
