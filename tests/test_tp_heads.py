"""Tensor parallelism with fewer KV heads than ranks (each KV head replicated on the ranks that read it), through the
fixed-shape decode step, against Hugging Face; a TP that does not fit is a clear error before any rank starts."""
import pytest
import torch

from engine import EngineConfig
from engine.engine import Engine
from tests.hf_reference import hf_model
from tests.test_paged_engine import prompts
from tests.test_tensor_parallel import check_hf, run, tp_engine


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path):
    import transformers

    from tests.checkpoints import write_tokenizer
    from tests.test_paged_engine import BASE

    config = transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 1})
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    engine = tp_engine(str(tmp_path), decode_graphs="eager")  # the fixed-shape decode step under TP too
    try:
        assert engine.heads.replicas == 2 and engine.pool.kv_heads == 1
        check_hf(run(engine, prompts(3, seed=9)), hf_model(model))
        assert engine.runner.graphs.runs > 0
    finally:
        engine.close()


def test_tp_that_does_not_divide_the_heads_names_the_fix():
    with pytest.raises(ValueError, match=r"--tp 3 does not divide .* use one of \[1, 2, 4\]"):
        Engine(EngineConfig(tp=3))
