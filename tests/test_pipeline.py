"""Pipeline parallelism on the CPU (stages as processes, hidden states over tcp and shm): greedy tokens and
logprobs of 2- and 3-stage pipelines equal Hugging Face's and one stage's, with micro-batches in flight, chunked
prompts, cached prefixes and preemption; no block leaks; a layer split or a stage that disagrees is refused; a stage
that dies is noticed at once."""
import os
import signal
import time

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from engine.pipeline.split import stage_spans
from engine.sequence import Sequence
from tests.hf_reference import hf_model
from tests.test_paged_engine import GREEDY, check, prompts, write_family


def pp_engine(path=None, pp=2, **kw):
    extra = {"model": path} if path else {}
    return Engine(EngineConfig(threads=1, block_size=8, pp=pp, warmup=False, dtype="float32", **extra, **kw))


def run(engine, ps, max_tokens=8):
    return [s for _, s in generate_many(engine, ps, [SamplingParams(max_tokens=max_tokens, **GREEDY) for _ in ps])]


def test_stage_spans_split_evenly_or_as_told_and_refuse_what_cannot_be():
    assert stage_spans(32, 2) == [(0, 16), (16, 32)]
    assert stage_spans(4, 3) == [(0, 1), (1, 2), (2, 4)]  # stage 0 (which also samples) gets the fewer
    assert stage_spans(32, 2, "10,22") == [(0, 10), (10, 32)]
    for pp, layers, words in [(2, "10,21", "add up to"), (3, "10,22", "names 2 stages"), (2, "0,32", "every stage"),
                              (2, "a,b", "layer counts"), (5, None, "more stages")]:
        with pytest.raises(ValueError, match=words):
            stage_spans(4 if layers is None else 32, pp, layers)
    with pytest.raises(ValueError, match="--pp and --tp"):
        EngineConfig(pp=2, tp=2)


def test_stages_take_the_devices_listed_one_each():
    from engine.loader import rank_device

    assert [rank_device("cpu,cpu", r, 2).type for r in range(2)] == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="names 2 devices for 3"):
        rank_device("cpu,cpu", 0, 3)


def test_kv_moves_between_splits_by_the_overlap_of_their_layers():
    from engine.pipeline.split import layer_pieces

    prefill = [[0, 3], [3, 6], [6, 8]]
    assert layer_pieces(prefill, (0, 4)) == [(0, 3), (3, 4)]  # decode stage 0 of 2: two pieces
    assert layer_pieces(prefill, (4, 8)) == [(4, 6), (6, 8)]
    assert layer_pieces([[0, 8]], (4, 8)) == [(4, 8)]  # from one process: its share in one piece
    assert layer_pieces(prefill, (0, 8)) == [(0, 3), (3, 6), (6, 8)]  # into one process: each stage's layers


@pytest.mark.parametrize("family,pp,transport", [("llama", 2, "tcp"), ("qwen3-moe", 3, "shm")])
def test_pipeline_matches_hf_and_one_stage(tmp_path, family, pp, transport):
    path = write_family(tmp_path, family)
    hf = hf_model(path)
    engine = pp_engine(path, pp, pp_transport=transport)
    try:
        assert [tuple(s) for s in engine.stage.stages.spans] == stage_spans(3, pp)
        assert len(engine.pool.layers) == stage_spans(3, pp)[0][1]  # stage 0's pool holds its layers only
        ps = prompts(8, seed=11)
        seqs = run(engine, ps)
        check(seqs, hf, 8)
        assert engine.stage.most_in_flight == pp  # the eight went as pp micro-batches in flight together
        hops = seqs[0].pp_hops
        assert len(hops) == pp and all(h["count"] >= 8 and h["bytes"] > 0 and h["wire"] > 0 for h in hops)
        single = run(Engine(EngineConfig(model=path, threads=1, block_size=8, warmup=False)), ps)
        assert [s.output_ids for s in seqs] == [s.output_ids for s in single]
        assert engine.blocks.num_free == engine.num_blocks
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["nixl", "pickle", "nccl"])  # nccl's protocol over gloo on the CPU
def test_hidden_states_go_over_other_transports_too(transport):
    pytest.importorskip("nixl") if transport == "nixl" else None
    ps = prompts(3, seed=4)
    want = [s.output_ids for s in run(Engine(EngineConfig(threads=1, block_size=8, warmup=False)), ps, 6)]
    engine = pp_engine(pp=2, pp_transport=transport)
    try:
        assert [s.output_ids for s in run(engine, ps, 6)] == want
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_pp():
    engine = pp_engine(pp=2, num_blocks=40)
    yield engine
    engine.close()


def test_chunks_cached_prefixes_and_preemption_match_one_stage(tiny_pp, monkeypatch):
    engine = tiny_pp
    reference = Engine(EngineConfig(threads=1, block_size=8, warmup=False, dtype="float32", num_blocks=40))
    base = prompts(1, seed=5)[0] * 2
    ps = [base + [7, 8, 9], base + [10, 11], base, *prompts(5, seed=6)]
    for e in (engine, reference):
        monkeypatch.setattr(e.scheduler, "max_batched_tokens", 24)  # prompts in chunks, mixed with decodes
    hits, preempted = engine.prefix_hits, engine.scheduler.preemptions
    got = run(engine, ps[:1], 24) + run(engine, ps[1:], 24)
    want = run(reference, ps[:1], 24) + run(reference, ps[1:], 24)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    for a, b in zip(got, want):
        assert [e[1] for e in a.pending_logprobs] == pytest.approx([e[1] for e in b.pending_logprobs], abs=1e-4)
    assert engine.prefix_hits > hits and engine.scheduler.preemptions > preempted  # 40 blocks: some had to wait
    assert engine.blocks.num_free == engine.num_blocks and all(r == 0 for r in engine.blocks.refs)


def test_a_long_prompt_goes_through_in_pipelined_chunks(monkeypatch):
    engine = pp_engine(pp=2, num_blocks=64, max_batched_tokens=16)
    reference = Engine(EngineConfig(threads=1, block_size=8, warmup=False, dtype="float32", num_blocks=64))
    try:
        prompt = prompts(1, seed=9)[0] * 3  # several chunks of 16
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        got = generate_many(engine, [prompt], [params])[0][1]
        want = generate_many(reference, [prompt], [SamplingParams(**params.to_dict())])[0][1]
        assert engine.stage.most_in_flight == 2  # the next chunk followed the one before into the pipeline
        assert got.output_ids == want.output_ids
        assert [e[0] for e in got.prompt_logprob_list[1:]] == pytest.approx(
            [e[0] for e in want.prompt_logprob_list[1:]], abs=1e-4)
        assert engine.blocks.num_free == engine.num_blocks
    finally:
        engine.close()


def test_aborts_in_flight_leave_no_block_behind(tiny_pp):
    engine = tiny_pp
    seqs = [Sequence.create(f"a{i}", "ab" * (4 + i), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                            engine.tokenizer, engine.max_len) for i in range(6)]
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps in (3, 6):  # freed while its micro-batch may be in the pipeline
            engine.free(seqs[steps // 3])
    assert all(s.finished for i, s in enumerate(seqs) if i not in (1, 2))
    assert engine.blocks.num_free == engine.num_blocks and all(r == 0 for r in engine.blocks.refs)


def test_a_stage_that_disagrees_is_refused():
    from engine.pipeline.launch import Stages

    stages = Stages.__new__(Stages)
    stages.spans = [(0, 2), (2, 4)]
    own = {"model": "tiny-llama", "layers": 4, "hidden": 64, "vocab": 259, "dtype": "torch.float32", "block_size": 8}
    stages._check({"stage": 1, "span": [2, 4], "model": own}, own)
    with pytest.raises(RuntimeError, match="stage 1 holds layers"):
        stages._check({"stage": 1, "span": [1, 4], "model": own}, own)
    with pytest.raises(RuntimeError, match="another model.*dtype"):
        stages._check({"stage": 1, "span": [2, 4], "model": {**own, "dtype": "torch.bfloat16"}}, own)


@pytest.mark.serial
def test_a_stage_that_dies_is_noticed_at_once():
    engine = pp_engine(pp=3)
    lost = []
    engine.stage.stages.on_lost = lambda stage, code: lost.append((stage, code, time.monotonic()))
    try:
        run(engine, prompts(2, seed=1), 4)
        victim = engine.stage.stages.procs[2]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        while not lost and time.monotonic() - killed < 5:
            time.sleep(0.05)
        assert lost and lost[0][:2] == (2, -signal.SIGKILL) and lost[0][2] - killed < 1.0
    finally:
        engine.stage.stages.closing = True
        engine.close()


def scaled_checkpoint(tmp_path) -> str:
    """A Llama checkpoint whose layers have FP8 KV scales of their own (2.5, 1.5, 0.5 for K; 0.25 for V)."""
    from safetensors.torch import load_file, save_file

    path = write_family(tmp_path, "llama")
    state = load_file(os.path.join(path, "model.safetensors"))
    for i in range(3):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(2.5 - i)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


def test_an_fp8_kv_cache_is_split_with_each_stages_scales(tmp_path):
    path = scaled_checkpoint(tmp_path)
    ps = prompts(3, seed=9)
    engine = pp_engine(path, kv_cache_dtype="fp8")
    try:
        assert engine.pool.layers[0][0].dtype.itemsize == 1 and engine.kv_scales == [(2.5, 0.25)]  # stage 0: layer 0
        seqs = run(engine, ps)
    finally:
        engine.close()
    single = run(Engine(EngineConfig(model=path, threads=1, kv_cache_dtype="fp8")), ps)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in single]


def test_decode_steps_of_a_pipeline_take_the_fixed_shape_path(tmp_path):
    """``decode_graphs=eager``: each stage's decode steps run the padded fixed-shape forward a CUDA graph captures
    (stage 0 from token ids, the others from the residual stream in a static buffer) and equal one stage."""
    path = write_family(tmp_path, "llama")
    ps = prompts(5, seed=11)
    engine = pp_engine(path, decode_graphs="eager")
    try:
        seqs = run(engine, ps)
        assert engine.runner.graphs.part == "first" and engine.runner.graphs.runs > 0
    finally:
        engine.close()
    single = run(Engine(EngineConfig(model=path, threads=1, dtype="float32")), ps)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in single]


def test_stage_zero_waits_for_every_stage_ready_and_keeps_other_reports():
    """A hop must not reach a stage still capturing its CUDA graphs (an allocation mid-capture fails it): stage 0
    waits for each stage's ``ready``; reports of other kinds stay queued for their readers; a dead stage fails."""
    import queue

    from engine.pipeline.launch import Stages

    class Proc:
        def __init__(self, code=None):
            self.returncode = code

        def poll(self):
            return self.returncode

    stages = Stages.__new__(Stages)
    stages.procs, stages.reports = {1: Proc(), 2: Proc()}, queue.Queue()
    for msg in ({"kind": "ready", "stage": 2}, {"kind": "adopted", "rid": "r"}, {"kind": "ready", "stage": 1}):
        stages.reports.put(msg)
    stages.wait_ready(timeout_s=5)
    assert stages.reports.get_nowait() == {"kind": "adopted", "rid": "r"} and stages.reports.empty()
    with pytest.raises(RuntimeError, match="not ready"):
        stages.wait_ready(timeout_s=0.3)
    stages.procs[2] = Proc(code=1)
    with pytest.raises(RuntimeError, match="stage 2 exited"):
        stages.wait_ready(timeout_s=5)
