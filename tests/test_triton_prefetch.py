"""o's weight pulled into L2 during attention (``engine.kernels.triton_prefetch``): issued for few-row decode
steps only, with o's own weight; on a GPU it changes no number."""
import importlib.util
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(dtype: str, graphs: str):
    from engine import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(device=DEVICE, dtype=dtype, decode_graphs=graphs, threads=1, max_num_seqs=8))


def _tokens(engine, prompts) -> list:
    from engine import SamplingParams
    from engine.generate import generate_many

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [r[1].output_ids for r in generate_many(engine, prompts, [greedy] * len(prompts))]


def test_decode_steps_of_few_rows_prefetch_o_weights_and_only_those():
    from engine.kernels import triton_attention, triton_layers
    from engine.models.llama import use_kernels

    engine = _engine("float32", "eager")
    engine.runner.graphs.ops = triton_attention
    use_kernels(engine.model, triton_layers)
    seen = []
    fake = types.SimpleNamespace(takes=lambda rows: rows <= 2, l2=lambda w: seen.append(w.data_ptr()))
    for layer in engine.model.owned_layers:
        layer.self_attn.prefetch = fake
    o_weights = {layer.self_attn.o_proj.weight.data_ptr() for layer in engine.model.owned_layers}
    _tokens(engine, ["one prompt"])
    assert seen and set(seen) == o_weights  # batch 1: every layer, every step
    count = len(seen)
    _tokens(engine, ["a", "b", "c"])  # steps of 4 rows (padded): none
    assert len(seen) == count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch is PTX: CUDA only")
def test_prefetch_changes_no_token_on_the_gpu():
    from engine.kernels import triton_prefetch

    w = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    triton_prefetch.l2(w)
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    prompts = ["hello", "the same prompt on both engines"]
    with_it = _engine("bfloat16", "cuda")
    on = [_tokens(with_it, [p]) for p in prompts]
    assert all(layer.self_attn.prefetch is triton_prefetch for layer in with_it.model.owned_layers)
    without = _engine("bfloat16", "cuda")
    for layer in without.model.owned_layers:
        layer.self_attn.prefetch = None
    assert on == [_tokens(without, [p]) for p in prompts]
