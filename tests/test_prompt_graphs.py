"""A prompt chunk through ``engine.cuda_graphs.prompt`` (padded to a token bucket, the padding a second sequence that
writes no K/V; after a cached prefix, its keys gathered from the pool up to a context bucket): here its CPU form,
the same padded forward without capture. The same tokens and logprobs (1e-4) as the eager step, for fresh prompts
under, at and over a bucket and for chunks after cached prefixes, with and without a sliding window; prompt
logprobs stay eager; fresh prompts of one step go through one padded forward together; the padding writes nothing to
the pool."""
import pytest
import torch

from engine import SamplingParams
from engine.generate import generate_many
from engine.kernels import paged
from engine.cuda_graphs.prompt import ROWS, PromptGraphs, context_buckets, token_buckets
from tests.test_paged_engine import GREEDY, engine_for, write_family


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else None
    return write_family(tmp_path_factory.mktemp(request.param), request.param, overrides)


def _engine(path, graphs: bool, caching: bool = True):
    engine = engine_for(path, device="cpu", decode_graphs="eager", prefix_caching=caching)
    for layer in engine.model.owned_layers:
        layer.self_attn.prompt_ops = paged  # the fused prompt path (what CUDA engines run through Triton)
    if graphs:
        engine.runner.graphs.prompts = PromptGraphs(engine.model, engine.pool, engine.device, 64, capture=False,
                                                    most_context=engine.max_len)
    return engine


def _run(engine, prompts, **params):
    out = generate_many(engine, prompts, [SamplingParams(max_tokens=5, **GREEDY, **params)] * len(prompts))
    return [(s.output_ids, [e[1] for e in s.pending_logprobs]) for _, s in out]


def test_token_buckets():
    assert token_buckets(64) == [16, 32, 48, 64] and token_buckets(100) == [16, 32, 48, 64, 80, 96, 112]
    assert token_buckets(600)[-5:] == [448, 480, 512, 576, 640] and len(token_buckets(1024)) == 32
    assert context_buckets(0) == [] and context_buckets(512) == [512, 1024] and context_buckets(700) == [512, 1024]


def test_fresh_prompts_through_the_padded_forward_match_the_eager_step(model):
    prompts = [[5], list(range(3, 18)), list(range(3, 19)), list(range(20, 60)), list(range(3, 100))]
    eager, padded = _engine(model, False, caching=False), _engine(model, True, caching=False)
    for prompt in prompts:  # one at a time: single-row prompt steps
        want, got = _run(eager, [prompt]), _run(padded, [prompt])
        assert got[0][0] == want[0][0]
        torch.testing.assert_close(torch.tensor(got[0][1]), torch.tensor(want[0][1]), atol=1e-4, rtol=0)
    # one token is a decode row (the decode path); 97 tokens are over the top bucket (eager)
    assert padded.runner.graphs.prompts.runs == 3


def test_chunks_after_cached_prefixes_through_the_padded_forward_match_the_eager_step(model):
    eager, padded = _engine(model, False), _engine(model, True)
    turns = [list(range(3, 40)), list(range(3, 40)) + [7, 8, 9], list(range(3, 40)) + [7, 8, 9, 11] * 6]
    for prompt in turns:  # each turn's prefix is cached by the one before
        want, got = _run(eager, [prompt]), _run(padded, [prompt])
        assert got[0][0] == want[0][0]
        torch.testing.assert_close(torch.tensor(got[0][1]), torch.tensor(want[0][1]), atol=1e-4, rtol=0)
    assert padded.cached_tokens > 0 and padded.runner.graphs.prompts.runs == 3


def test_prompt_logprobs_stay_eager(model):
    engine = _engine(model, True)
    _run(engine, [list(range(50, 60))], prompt_logprobs=0)
    assert engine.runner.graphs.prompts.runs == 0


def test_fresh_prompts_packed_into_one_padded_forward_match_the_eager_step(model):
    """Several fresh prompts in one step go through one graph (each its own sequence, ``ROWS - K`` one-token padding
    sequences after them); more than ``ROWS`` prompts, or over the top bucket with their padding, stay eager."""
    batches = [[list(range(3, 13)), list(range(20, 25))],
               [list(range(30, 42)), list(range(50, 65)), list(range(70, 79))],
               [list(range(3 + i, 7 + i)) for i in range(ROWS)],
               [list(range(3 + i, 6 + i)) for i in range(ROWS + 1)],  # one more than a graph packs
               [list(range(3, 42)), list(range(42, 62))]]  # 59 tokens and 6 of padding: over 64
    eager, padded = _engine(model, False, caching=False), _engine(model, True, caching=False)
    for prompts in batches:
        want, got = _run(eager, prompts), _run(padded, prompts)
        assert [g[0] for g in got] == [w[0] for w in want]
        torch.testing.assert_close(torch.tensor([g[1] for g in got]), torch.tensor([w[1] for w in want]),
                                   atol=1e-4, rtol=0)
    assert padded.runner.graphs.prompts.runs == 3


def test_the_padding_writes_nothing_to_the_pool(model):
    engine = _engine(model, True)
    pool = [t for pair in engine.pool.layers for t in pair]
    before = [t.clone() for t in pool]
    _run(engine, [list(range(3, 6))])  # 3 tokens padded to 16
    slots = {tuple(s) for a, b in zip(pool, before) for s in (a != b).flatten(2).any(2).nonzero().tolist()}
    assert len(slots) == 7  # the prompt's 3 tokens and the 4 decoded ones fed back; none of the 13 padding rows
    before = [t.clone() for t in pool]
    _run(engine, [list(range(10, 14)), list(range(20, 25))])  # 9 tokens of two prompts and 7 padding in 16
    slots = {tuple(s) for a, b in zip(pool, before) for s in (a != b).flatten(2).any(2).nonzero().tolist()}
    assert len(slots) == 9 + 2 * 4 and engine.runner.graphs.prompts.runs == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prompt CUDA graphs need a GPU")
def test_captured_prompts_on_the_gpu_match_the_eager_step(monkeypatch):
    """The built-in tiny model in bf16: prompts under the top bucket replay a graph; tokens and logprobs as the
    eager step's until a near-tie (the padded GEMMs may round the last bit otherwise)."""
    from engine import EngineConfig
    from engine.engine import Engine

    prompts = ["hi there", "a longer prompt for the tiny model " * 4, "x" * 300,
               "a longer prompt for the tiny model " * 4 + "and a turn after it"]  # the last after a cached prefix
    out = {}
    for graphs in ("1", "0"):
        from engine.cuda_graphs import prompt

        monkeypatch.setattr(prompt, "MAX_TOKENS", 1024 if graphs == "1" else 0)
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=4))
        prompt_graphs = engine.runner.graphs.prompts
        assert (prompt_graphs is not None) == (graphs == "1")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        out[graphs] = [generate_many(engine, [p], [params])[0][1] for p in prompts]
        fresh = ["one of three prompts", "two of three prompts, a little longer", "three " * 20]  # packed in a graph
        out[graphs] += [seq for _, seq in generate_many(engine, fresh, [params] * 3)]
        turns = [prompts[1] + " and one more turn", fresh[2] + "and a last one"]  # after cached prefixes, packed
        out[graphs] += [seq for _, seq in generate_many(engine, turns, [params] * 2)]
        if prompt_graphs is not None:
            assert prompt_graphs.replays == len(prompts) + 2 and engine.cached_tokens > 0
    for got, want in zip(out["1"], out["0"]):
        same = next((i for i, (a, b) in enumerate(zip(got.output_ids, want.output_ids)) if a != b), 6)
        torch.testing.assert_close(torch.tensor([e[1] for e in got.pending_logprobs[:same]]),
                                   torch.tensor([e[1] for e in want.pending_logprobs[:same]]), atol=0.05, rtol=0.02)
        if same < 6:
            runner_up = dict(got.pending_logprobs[same][2])
            assert want.output_ids[same] in runner_up


def _reference_varlen(q, k, v, starts, longest, scale, window, k_starts=None, k_longest=None):
    """What the GPU's varlen kernel computes, on the CPU, from the cumulative starts tensors: each sequence's queries
    attend causally (from the bottom right) to its own keys."""
    import torch.nn.functional as F

    k_starts = starts if k_starts is None else k_starts
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(starts) - 1):
        s, e, ks, ke = (int(x) for x in (starts[i], starts[i + 1], k_starts[i], k_starts[i + 1]))
        assert e > s and ke > ks, "an empty sequence reached the kernel"
        qi, ki, vi = q[s:e].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        qpos, kpos = torch.arange(ke - ks - (e - s), ke - ks), torch.arange(ke - ks)
        mask = kpos[None, :] <= qpos[:, None]
        if window:
            mask &= kpos[None, :] > qpos[:, None] - window
        out[s:e] = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, scale=scale)[0] \
            .transpose(0, 1)
    return out


def test_the_device_buffers_the_graphs_read_hold_each_prompts_sequence(model, monkeypatch):
    """The captured form reads the packed starts, the last rows and the cached prefix's starts from device buffers
    (the CPU form from host lists): through a reference varlen kernel on those buffers, the same tokens and
    logprobs as the eager step, for packed fresh prompts and a chunk after a cached prefix."""
    import engine.attention as attention

    calls = []
    monkeypatch.setattr(attention, "varlen_kernel", lambda: lambda *a: calls.append((len(a), len(a[3])))
                        or _reference_varlen(*a))
    eager, padded = _engine(model, False), _engine(model, True)
    padded.runner.graphs.prompts.varlen = True
    for prompts in ([list(range(3, 13)), list(range(20, 25)), list(range(30, 47))], [list(range(3, 40))],
                    [list(range(3, 40)) + [7, 8, 9]]):  # the last after the one before's cached prefix
        want, got = _run(eager, prompts), _run(padded, prompts)
        assert [g[0] for g in got] == [w[0] for w in want]
        torch.testing.assert_close(torch.tensor([g[1] for g in got]), torch.tensor([w[1] for w in want]),
                                   atol=1e-4, rtol=0)
    assert padded.runner.graphs.prompts.runs == 3 and padded.cached_tokens > 0
    assert set(calls) == {(7, ROWS + 2), (9, ROWS + 2)}  # fresh (varlen) and cached (keys gathered) forms


@pytest.mark.parametrize("varlen", [False, True], ids=["cpu-form", "device-buffers"])
def test_chunks_after_cached_prefixes_packed_with_fresh_prompts_match_the_eager_step(model, monkeypatch, varlen):
    """Two conversations' next turns (after their cached prefixes) and a fresh prompt in one step: one graph, each
    chunk attending to its own context through its block table; the same tokens and logprobs as the eager step."""
    import engine.attention as attention

    monkeypatch.setattr(attention, "varlen_kernel", lambda: _reference_varlen)
    eager, padded = _engine(model, False), _engine(model, True)
    padded.runner.graphs.prompts.varlen = varlen
    a, b = list(range(3, 30)), list(range(50, 72))
    for prompts in ([a, b], [a + [7, 8, 9], b + [11] * 5, list(range(100, 112))]):
        want, got = _run(eager, prompts), _run(padded, prompts)
        assert [g[0] for g in got] == [w[0] for w in want]
        torch.testing.assert_close(torch.tensor([g[1] for g in got]), torch.tensor([w[1] for w in want]),
                                   atol=1e-4, rtol=0)
    assert padded.runner.graphs.prompts.runs == 2 and padded.cached_tokens >= 32
