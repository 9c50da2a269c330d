"""Steps that decode and take prompt chunks through ``engine.cuda_graphs.mixed`` (one forward padded to a token
bucket, attention through ``kernels.triton_mixed``): here its CPU form, the same padded forward without capture (the
kernel in Triton's interpreter).
The same tokens and logprobs (1e-4) as the one eager mixed forward, for fresh prompts and chunks after cached prefixes
beside decode rows (their keys split where they are many), with and without a sliding window; prompt logprobs and steps past the top bucket stay eager; the
padding writes nothing to the pool; on a GPU the captured pieces match the eager step."""
import pytest
import torch

from tests.triton_env import needs_triton  # first: the interpreter where there is no GPU
from engine import SamplingParams
from engine.cuda_graphs.mixed import MixedGraphs
from engine.kernels import paged, triton_mixed
from engine.sequence import Sequence
from tests.test_paged_engine import GREEDY, engine_for, write_family


pytestmark = needs_triton
cpu_form = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form runs the kernel in Triton's interpreter, "
                              "which a machine with a GPU does not start; the captured form's test covers it there")


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else None
    return write_family(tmp_path_factory.mktemp(request.param), request.param, overrides)


def _engine(path, graphs: bool, caching: bool = False, most_tokens: int = 64):
    engine = engine_for(path, device="cpu", decode_graphs="eager", prefix_caching=caching)
    for layer in engine.model.owned_layers:
        layer.self_attn.prompt_ops = paged  # the fused prompt path (what CUDA engines run through Triton)
    if graphs:
        max_blocks = -(-engine.max_len // engine.block_size) + 1
        engine.runner.graphs.mixed = MixedGraphs(engine.model, engine.pool, engine.device, most_tokens, 8, max_blocks,
                                                 False, rope=paged)
    return engine


def _arrivals(engine, waves: list[list[list[int]]], params: SamplingParams) -> list:
    """Each wave of prompts added once the sequences before it have two tokens out (so they decode beside it);
    ``(output ids, logprobs)`` of every sequence once all finish."""
    seqs = []
    for wave in waves:
        while any(len(s.output_ids) < 2 and not s.finished for s in seqs):
            engine.step()
        for prompt in wave:
            seq = Sequence.create(str(len(seqs)), prompt, params, engine.tokenizer, engine.max_len)
            engine.add(seq)
            seqs.append(seq)
    while not all(s.finished for s in seqs):
        engine.step()
    assert engine.blocks.num_free == engine.num_blocks or engine.cfg.prefix_caching
    return [(s.output_ids, [e[1] for e in s.pending_logprobs]) for s in seqs]


def _same(got, want) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)


@cpu_form
def test_prompts_arriving_while_others_decode_match_the_eager_mixed_step(model):
    waves = [[list(range(3, 23))], [list(range(40, 52)), list(range(60, 69))], [list(range(5, 30))]]
    params = SamplingParams(max_tokens=8, **GREEDY)
    want = _arrivals(_engine(model, False), waves, params)
    engine = _engine(model, True)
    _same(_arrivals(engine, waves, params), want)
    assert engine.runner.graphs.mixed.runs >= 3  # the first prompt alone, then each wave beside decode rows


@cpu_form
def test_chunks_after_cached_prefixes_beside_decode_rows_match_the_eager_mixed_step(model):
    history = list(range(3, 40))
    waves = [[history], [list(range(50, 61))], [history + [7, 8, 9, 11]], [history + [7, 8, 9, 11] * 3]]
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = _arrivals(_engine(model, False, caching=True), waves, params)
    engine = _engine(model, True, caching=True)
    _same(_arrivals(engine, waves, params), want)
    assert engine.cached_tokens > 0 and engine.runner.graphs.mixed.runs >= 3


@cpu_form
def test_chunks_and_rows_over_long_contexts_split_their_keys_and_match_the_eager_mixed_step(model, monkeypatch):
    cut, merged = triton_mixed.cut, []

    def spy(*args):
        tiles, merges = cut(*args)
        merged.append(len(merges))
        return tiles, merges

    monkeypatch.setattr(triton_mixed, "SPLIT_KEYS", 32)  # past two key tiles: split
    monkeypatch.setattr(triton_mixed, "cut", spy)
    history = list(range(3, 160))
    waves = [[history], [history + [7, 8, 9, 11]], [history + [5, 6] * 12, list(range(100, 250))]]
    params = SamplingParams(max_tokens=5, **GREEDY)
    want = _arrivals(_engine(model, False, caching=True), waves, params)
    engine = _engine(model, True, caching=True, most_tokens=128)
    _same(_arrivals(engine, waves, params), want)
    windowed = engine.model.spec.sliding_window
    assert (max(merged) > 0) != bool(windowed)  # a window of 12 keys reads too few to split


@cpu_form
def test_prompt_logprobs_and_steps_past_the_top_bucket_stay_eager(model):
    engine = _engine(model, True, most_tokens=16)
    params = SamplingParams(max_tokens=4, **GREEDY)
    _arrivals(engine, [[list(range(3, 10))], [list(range(20, 60))]], params)  # 40 tokens and a decode row: past 16
    runs = engine.runner.graphs.mixed.runs
    assert runs == 1  # only the first prompt, 7 tokens
    _arrivals(engine, [[list(range(3, 10))]], SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY))
    assert engine.runner.graphs.mixed.runs == runs


@cpu_form
def test_the_padding_writes_nothing_to_the_pool(model):
    engine = _engine(model, True)
    pool = [t for pair in engine.pool.layers for t in pair]
    before = [t.clone() for t in pool]
    _arrivals(engine, [[list(range(3, 6))], [list(range(10, 14))]], SamplingParams(max_tokens=4, **GREEDY))
    slots = {tuple(s) for a, b in zip(pool, before) for s in (a != b).flatten(2).any(2).nonzero().tolist()}
    assert len(slots) == (3 + 3) + (4 + 3)  # prompts and the decoded tokens fed back; none of the padding rows
    assert engine.runner.graphs.mixed.runs >= 2


@cpu_form
def test_a_small_step_after_a_large_one_reads_only_its_own_rows(model):
    """The rows a bucket's logits read are staged whole each step: a step of one bucket after a step of more
    sequences in a larger one reads none of the larger step's rows (on a GPU an index past the bucket is a
    device-side fault that ends the worker)."""
    from engine.generate import generate_many

    def run(engine):
        many = generate_many(engine, [list(range(3 + i, 12 + i)) for i in range(7)], [SamplingParams(max_tokens=1,
                                                                                                   **GREEDY)] * 7)
        one = generate_many(engine, [[40, 41, 42]], [SamplingParams(max_tokens=1, **GREEDY)])
        return [(s.output_ids, [e[1] for e in s.pending_logprobs]) for _, s in many + one]

    engine = _engine(model, True)
    _same(run(engine), run(_engine(model, False)))
    assert engine.runner.graphs.mixed.runs == 2  # 63 tokens of 7 sequences in 64, then 3 tokens in 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed-step CUDA graphs need a GPU")
def test_captured_mixed_steps_on_the_gpu_match_the_eager_step():
    """The built-in tiny model in bf16: prompts arriving while others decode replay the pieces; tokens and logprobs
    as the eager mixed step's until a near-tie (the padded GEMMs may round the last bit otherwise)."""
    from engine import EngineConfig
    from engine.engine import Engine

    waves = [[list(range(3, 40))], [list(range(50, 170)), list(range(10, 30))], [list(range(3, 40)) + [9] * 20]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    out = {}
    for captured in (True, False):
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=8))
        mixed = engine.runner.graphs.mixed
        assert mixed is not None and mixed.capture
        if not captured:
            engine.runner.graphs.mixed = None
        out[captured] = _arrivals(engine, waves, params)
        assert not captured or mixed.replays >= 2
    for (got, got_lps), (want, want_lps) in zip(out[True], out[False]):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
        torch.testing.assert_close(torch.tensor(got_lps[:same]), torch.tensor(want_lps[:same]), atol=0.05, rtol=0.02)
        assert same >= 2
