"""o's weight pulled into L2 on a side stream during attention (``engine.kernels.triton_prefetch``): forked for
decode steps of few rows only, with o's own weight, joined before o runs; on a GPU it changes no token in any mode."""
import types

import pytest
import torch

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


def test_decode_steps_of_few_rows_fork_a_pull_of_o_weights_and_join_it_before_o():
    engine = _engine("float32", "eager")
    events = []
    fake = types.SimpleNamespace(takes=lambda rows: rows <= 2,
                                 start=lambda w: events.append(("start", w.data_ptr())) or "side",
                                 join=lambda side: events.append(("join", side)))
    o_weights = set()
    for layer in engine.model.owned_layers:
        layer.self_attn.prefetch = fake
        o_weights.add(layer.self_attn.o_proj.weight.data_ptr())
        o_forward = layer.self_attn.o_proj.forward
        layer.self_attn.o_proj.forward = lambda x, f=o_forward: events.append(("o", None)) or f(x)
    _tokens(engine, ["one prompt"])
    starts = [w for kind, w in events if kind == "start"]
    assert starts and set(starts) == o_weights  # batch 1: every layer, every decode step
    decode = events[events.index(("start", starts[0])):]
    for i, (kind, w) in enumerate(decode):
        if kind == "start":  # o runs only after its pull joined the step's stream
            assert decode[i + 1] == ("join", "side") and decode[i + 2] == ("o", None)
    count = len(starts)
    _tokens(engine, ["a", "b", "c"])  # steps of 4 rows (padded): none
    assert len([e for e in events if e[0] == "start"]) == count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pull is PTX: CUDA only")
@pytest.mark.parametrize("mode", ["bulk", "line", "load"])
def test_a_pull_changes_no_weight_and_no_token_on_the_gpu(mode):
    from engine.kernels import triton_prefetch

    if mode == "bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk needs sm_90")
    w = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    triton_prefetch.l2(w, mode)
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    prompts = ["hello", "the same prompt on both engines"]
    triton_prefetch.MODE = mode  # before the engine: its decode graphs are captured as it starts
    try:
        with_it = _engine("bfloat16", "cuda")
        assert all(layer.self_attn.prefetch is triton_prefetch for layer in with_it.model.owned_layers)
        on = [_tokens(with_it, [p]) for p in prompts]
    finally:
        triton_prefetch.MODE = triton_prefetch._mode()
    without = _engine("bfloat16", "cuda")
    for layer in without.model.owned_layers:
        layer.self_attn.prefetch = None
    assert on == [_tokens(without, [p]) for p in prompts]
