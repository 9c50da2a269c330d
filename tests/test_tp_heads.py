"""Tensor parallelism with fewer KV heads than ranks (each KV head replicated on the ranks that read it), through the
fixed-shape decode step, against Hugging Face; a TP that does not fit is a clear error before any rank starts."""
import pytest

from engine import EngineConfig
from engine.engine import Engine
from tests.hf_reference import hf_model
from tests.test_paged_engine import prompts, write_family
from tests.test_tensor_parallel import check_hf, run, tp_engine


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path):
    path = write_family(tmp_path, "llama", {"num_key_value_heads": 1})
    engine = tp_engine(path, decode_graphs="eager")  # the fixed-shape decode step under TP too
    try:
        assert engine.heads.replicas == 2 and engine.pool.kv_heads == 1
        check_hf(run(engine, prompts(3, seed=9)), hf_model(path))
        assert engine.runner.graphs.runs > 0
    finally:
        engine.close()


def test_more_ranks_than_gpus_names_the_count():
    import torch

    count = torch.cuda.device_count()
    tp = max(2, count + 1)
    with pytest.raises(ValueError, match=rf"--tp {tp} from cuda:0 needs {tp} GPUs; this machine has {count}"):
        Engine(EngineConfig(tp=tp, device="cuda"))


def test_tp_that_does_not_divide_the_heads_names_the_fix():
    with pytest.raises(ValueError, match=r"--tp 3 does not divide .* use one of \[1, 2, 4\]"):
        Engine(EngineConfig(tp=3))


def test_dummy_weights_are_the_same_at_any_tp():
    """``--load-format dummy`` draws each checkpoint tensor whole from a seed of its name, then slices it: TP=2 and
    TP=1 run the same model (what GPU benchmarks of shapes without checkpoints compare)."""
    cfg = dict(model="chat-cpu", load_format="dummy", threads=1, max_model_len=512, block_size=8)
    ps = prompts(3, seed=4)
    single = run(Engine(EngineConfig(**cfg)), ps)
    engine = Engine(EngineConfig(**cfg, tp=2))
    try:
        sharded = run(engine, ps)
    finally:
        engine.close()
    assert [s.output_ids for s in sharded] == [s.output_ids for s in single]
    for a, b in zip(sharded, single):
        assert [e[1] for e in a.pending_logprobs] == pytest.approx([e[1] for e in b.pending_logprobs], abs=1e-4)
