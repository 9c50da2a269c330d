"""The step ahead (``engine.overlap``) under tensor parallelism: rank 0 launches the next decode step before reading
this one's tokens and broadcasts them on the device to the other rank, whose next step takes them as input
(``StepRow.feed``). On the CPU (gloo, two rank processes, the fixed-shape decode step run eagerly): greedy and
seeded sampled tokens and logprobs equal TP=1's, with the steps left on the device counted."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from tests.test_paged_engine import GREEDY, prompts, write_family


def outputs(engine, ps, params):
    seqs = [s for _, s in generate_many(engine, ps, params)]
    return [s.output_ids for s in seqs], [[e[1] for e in s.pending_logprobs] for s in seqs]


@pytest.mark.parametrize("overlap", [True, False])
def test_tp2_steps_ahead_with_rank0s_tokens_on_the_device(tmp_path, overlap):
    path = write_family(tmp_path, "llama")
    ps = prompts(4, seed=11)
    params = [SamplingParams(max_tokens=10, **GREEDY), SamplingParams(max_tokens=10, **GREEDY),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=0),
              SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=9, logprobs=0)]
    kw = dict(model=path, threads=1, block_size=8, decode_graphs="eager", overlap=overlap)
    single = Engine(EngineConfig(**kw))
    want_ids, want_lp = outputs(single, ps, params)
    engine = Engine(EngineConfig(tp=2, **kw))
    try:
        got_ids, got_lp = outputs(engine, ps, params)
        assert got_ids == want_ids
        for got, want in zip(got_lp, want_lp):
            assert got == pytest.approx(want, abs=1e-4)
        assert (engine.overlapped > 0) == overlap and (single.overlapped > 0) == overlap
        assert engine.blocks.num_free == engine.num_blocks
    finally:
        engine.close()


def test_a_step_whose_choice_fails_still_feeds_the_other_rank(tmp_path, monkeypatch):
    """The other rank waits for rank 0's tokens after a step ahead: when choosing them raises, it gets zeros, so the
    group's collectives stay paired and the next requests come out right."""
    import engine.engine as engine_module

    path = write_family(tmp_path, "llama")
    ps, params = prompts(3, seed=12), [SamplingParams(max_tokens=8, **GREEDY) for _ in range(3)]
    kw = dict(model=path, threads=1, block_size=8, decode_graphs="eager")
    want = outputs(Engine(EngineConfig(**kw)), ps, params)
    engine = Engine(EngineConfig(tp=2, **kw))
    real, calls = engine_module.choose_later, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # a decode step ahead (the first step is the prompts')
            raise RuntimeError("a sampler error")
        return real(*args, **kwargs)
    try:
        monkeypatch.setattr(engine_module, "choose_later", fails_once)
        with pytest.raises(RuntimeError, match="a sampler error"):
            outputs(engine, ps, params)
        assert engine.overlapped > 0
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.free(seq)  # what a worker does with a failed step's requests
        while engine.has_work:
            engine.step()
        got = outputs(engine, ps, params)
        assert got[0] == want[0]
        for lp, want_lp in zip(got[1], want[1]):
            assert lp == pytest.approx(want_lp, abs=1e-4)
        assert engine.blocks.num_free == engine.num_blocks
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP on CUDA needs two GPUs")
def test_tp2_on_two_gpus_steps_ahead_through_the_graphs(tmp_path):
    """On two GPUs: the decode steps are CUDA graphs (the all-reduces captured in them) and the tokens go from rank
    0 to rank 1 by an NCCL broadcast; greedy and seeded sampled tokens equal TP=1's on one GPU (fp32)."""
    path = write_family(tmp_path, "llama")
    ps = prompts(4, seed=13)
    params = [SamplingParams(max_tokens=12, **GREEDY)] * 2 + [SamplingParams(max_tokens=12, temperature=0.7, seed=3)] * 2
    kw = dict(model=path, block_size=16, dtype="float32")
    single = Engine(EngineConfig(device="cuda:0", **kw))
    want_ids, _ = outputs(single, ps, params)
    engine = Engine(EngineConfig(device="cuda", tp=2, **kw))
    try:
        got_ids, _ = outputs(engine, ps, params)
        assert got_ids == want_ids
        assert engine.overlapped > 0 and engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    finally:
        engine.close()
