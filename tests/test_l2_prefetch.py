"""Weights read into L2 during a batch-1 step's attention and all-reduces (``engine.kernels.l2_prefetch``): the
reads change no token, happen where the module says (o's weights during attention; under TP gate/up's during the
all-reduce after o, the next layer's q/k/v during the one after down), on a GPU or under Triton's interpreter."""
import os

import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton


def test_the_prefetch_kernel_reads_and_changes_nothing():
    from engine.kernels.l2_prefetch import Prefetcher

    w = torch.randn(300, 70, device=DEVICE)
    before = w.clone()
    pf = Prefetcher(torch.device(DEVICE), 1 << 20)
    pf.fork(w)
    pf.join()
    pf.fork(torch.zeros(3, dtype=torch.float16, device=DEVICE))  # 6 bytes: not whole words, skipped
    assert pf.forked == 1 and torch.equal(w, before) and not pf.sink.any()
    assert pf.words_of(w).numel() == 300 * 70 and pf.words_of(w[:, :10]) is None  # strided: skipped


@pytest.mark.usefixtures("few_splits")
def test_tiny_engine_prefetching_during_attention_gives_the_same_tokens():
    from engine.kernels import l2_prefetch
    from tests.test_triton_gemv import batch1_on_the_kernels

    fast, run, want = batch1_on_the_kernels()
    pf = l2_prefetch.wire(fast.model, fast.device, megabytes=1)
    got = run()
    assert got == want
    layers = len(fast.model.owned_layers)
    assert pf.forked >= layers * 4 * 2  # every layer of every one-row step after the first token
    assert all(getattr(layer.self_attn.o_proj, "l2_next", None) is None for layer in fast.model.owned_layers)


class _Pair:
    """A group of two whose all-reduce doubles (as two equal ranks would sum), recording the order of events."""
    size = 2

    def __init__(self, events):
        self.events = events

    def all_reduce(self, x):
        self.events.append("all_reduce")
        return x * 2


def test_under_tp_the_all_reduces_prefetch_the_next_projection(monkeypatch):
    from engine import EngineConfig
    from engine.engine import Engine
    from engine.kernels import l2_prefetch, triton_gemv

    engine = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="off", threads=1))
    model, events = engine.model, []
    layers = model.owned_layers
    for layer in layers:
        layer.self_attn.o_proj.group = layer.ffn.down_proj.group = _Pair(events)
    pf = l2_prefetch.wire(model, engine.device, megabytes=1)
    for i, layer in enumerate(layers):
        assert layer.self_attn.o_proj.l2_next == (pf, layer.ffn.gate_up_proj.weight)
        after = layers[i + 1].self_attn.qkv_proj if i + 1 < len(layers) else model.lm_head
        assert layer.ffn.down_proj.l2_next == (pf, after.weight)
    monkeypatch.setattr(pf, "fork", lambda w: events.append(("fork", w.data_ptr())))
    monkeypatch.setattr(pf, "join", lambda: events.append("join"))
    o = layers[0].self_attn.o_proj
    x = torch.randn(1, o.in_features, device=DEVICE)
    got = triton_gemv.linear(x, o)
    torch.testing.assert_close(got, 2 * torch.nn.functional.linear(x, o.weight), rtol=1e-4, atol=1e-4)
    assert events == [("fork", layers[0].ffn.gate_up_proj.weight.data_ptr()), "all_reduce", "join"]


def test_off_by_default():
    from engine.kernels import l2_prefetch

    assert l2_prefetch.wire(object(), torch.device("cpu"), megabytes=0) is None
    if "PDSERVE_L2_PREFETCH_MB" not in os.environ:
        assert l2_prefetch.MB == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs with the side stream run on CUDA")
def test_bf16_decode_graphs_with_the_prefetch_give_the_same_tokens(monkeypatch):
    """The fork and join captured in the batch-1 decode graphs: the same greedy tokens and logprobs as without."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.kernels import l2_prefetch

    prompts, out = ["hello", "a longer prompt for the tiny model " * 3], {}
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for mb in (0, 8):
        monkeypatch.setattr(l2_prefetch, "MB", mb)
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=4))
        seqs = [generate_many(engine, [p], [greedy])[0][1] for p in prompts]  # batch 1
        out[mb] = [(s.output_ids, [lp for _, lp, _ in s.pending_logprobs]) for s in seqs]
        assert engine.runner.graphs.replays > 0
        assert (engine.model.model.layers[0].self_attn.l2 is not None) == (mb > 0)
    assert out[8] == out[0]


def test_the_prefetch_kernel_compiles_for_hopper():
    """Built for sm_90a: the loads are L2-only (``ld.global.cg``); ptxas refuses ``.cg`` together with an eviction
    hint, which the interpreter does not notice."""
    from engine.kernels import l2_prefetch
    from tests.triton_env import compile_for_hopper

    (built,) = compile_for_hopper([("engine.kernels.l2_prefetch", "_prefetch_kernel",
                                    {"src_ptr": "*i32", "sink_ptr": "*i32", "words": "i32"},
                                    {"WORDS": l2_prefetch.WORDS})])
    assert "error" not in built, built.get("error")
    assert "ld.global.cg" in built["ptx"] and built["cubin_bytes"] > 0
