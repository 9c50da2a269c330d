"""Tensor parallelism with an FP8 KV cache (CPU, gloo): each rank's pool holds its KV heads in e4m3 with the layer's
scales, the same on every rank. A module of its own: the TP engines of ``test_tensor_parallel`` hold this process's
rank-0 group while that module runs."""
from engine import EngineConfig
from engine.engine import Engine
from tests.test_paged_engine import prompts, write_family
from tests.test_tensor_parallel import run, tp_engine


def test_tp2_with_an_fp8_kv_cache_matches_tp1(tmp_path):
    """Each rank's pool holds its KV heads in e4m3 with the layer's scales (the same on every rank)."""
    path = write_family(tmp_path, "llama")
    ps = prompts(3, seed=7)
    engine = tp_engine(path, kv_cache_dtype="fp8")
    try:
        assert engine.pool.layers[0][0].dtype.itemsize == 1 and engine.kv_scales
        seqs = run(engine, ps)
    finally:
        engine.close()
    single = run(Engine(EngineConfig(model=path, threads=1, block_size=8, kv_cache_dtype="fp8")), ps)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in single]
