"""One step ahead (``engine.overlap``): with the next decode step launched before the one in flight is read, every
request gets the same tokens, text, logprobs and finish as when each step is read at once; stops found a step late
drop the extra token; aborts, requests joining mid-run and a small pool leak no block. The fixed-shape decode path
runs eagerly on the CPU (``decode_graphs="eager"``), the same code the CUDA graphs capture."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.sequence import PENDING, Sequence

PROMPTS = ["hello there", "a longer prompt for the tiny model " * 3, "x", "0123456789" * 4, "the end", "qq"]


def params(i: int) -> SamplingParams:
    kinds = [dict(temperature=0, ignore_eos=True), dict(temperature=0, stop=["b"]), dict(temperature=0.8, seed=7),
             dict(temperature=0, logprobs=2, ignore_eos=True), dict(temperature=1.0, top_k=20, seed=3, min_tokens=3),
             dict(temperature=0, stop_token_ids=[95])]
    return SamplingParams(max_tokens=5 + 4 * i, **kinds[i % len(kinds)])


GRAPHS = ["eager"] + (["cuda"] if torch.cuda.is_available() else [])  # cuda: captured graphs, the device feed


def run(overlap: bool, abort_at: int | None = None, graphs: str = "eager", **kw):
    engine = Engine(EngineConfig(threads=1, dtype="float32", decode_graphs=graphs, overlap=overlap, **kw))
    seqs = [Sequence.create(f"r{i}", p, params(i), engine.tokenizer, engine.max_len) for i, p in enumerate(PROMPTS)]
    texts, logprobs, steps, seen = {s.rid: "" for s in seqs}, {s.rid: [] for s in seqs}, 0, {}
    while engine.has_work or steps < len(seqs):
        if steps < len(seqs) and steps % 2 == 0:  # two join now, the rest later: mixed and pure decode steps
            for s in seqs[steps:steps + 2]:
                engine.add(s)
        out = engine.step()
        for tok in out.tokens:
            seq = tok.seq
            texts[seq.rid] += tok.text
            logprobs[seq.rid] += tok.logprobs or []
            assert tok.token == seq.output_ids[tok.index] and tok.index == seen.get(seq.rid, -1) + 1  # each in turn
            seen[seq.rid] = tok.index
            assert PENDING not in seq.output_ids[:seq.num_output]
        steps += 1
        if abort_at is not None and steps == abort_at:
            engine.free(seqs[3])
        if steps > 400:
            raise AssertionError("did not finish")
    results = {s.rid: (s.output_ids, s.finish_reason, texts[s.rid], logprobs[s.rid]) for s in seqs}
    return engine, results


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("abort_at", [None, 9])
def test_overlapped_steps_give_what_read_at_once_gives(abort_at, graphs):
    sync, want = run(False, abort_at, graphs)
    fast, got = run(True, abort_at, graphs)
    plain = run(False, abort_at, "off")[1]  # mixed steps (decode rows + prompt chunks in one forward) too
    for rid, (ids, reason, text, lps) in plain.items():
        assert want[rid][:3] == (ids, reason, text)
        assert [e["lp"] for e in want[rid][3]] == pytest.approx([e["lp"] for e in lps], abs=1e-5)
    assert sync.overlapped == 0 and fast.overlapped > 10
    if abort_at:
        assert 0 < len(got["r3"][0]) < params(3).max_tokens and got["r3"][1] is None  # aborted mid-run
    for rid in want:
        if rid == "r3" and abort_at:
            continue
        assert got[rid] == want[rid], rid
    assert [r[1] for r in got.values()].count("stop") == 2 and "length" in {r[1] for r in got.values()}
    for engine in (sync, fast):
        assert engine.inflight is None or not engine.has_work
        assert engine.blocks.num_free == engine.num_blocks and all(r == 0 for r in engine.blocks.refs)


def test_a_small_pool_falls_back_to_reading_each_step():
    """Preemption needs the tokens on the host: the engine reads the step in flight first, and outputs still match."""
    sync, want = run(False, num_blocks=14, block_size=4)
    fast, got = run(True, num_blocks=14, block_size=4)
    assert fast.scheduler.preemptions > 0 and fast.overlapped > 0
    assert got == want
    assert fast.blocks.num_free == fast.num_blocks


def test_held_places_fill_in_order_and_a_stop_drops_what_follows():
    engine = Engine(EngineConfig(threads=1, dtype="float32"))
    seq = Sequence.create("s", "hi", SamplingParams(max_tokens=10, stop_token_ids=[5]), engine.tokenizer, 100)
    a, b = seq.reserve(), seq.reserve()
    assert seq.pending == 2 and seq.num_output == 0
    from engine.sampler import TokenChoice

    seq.fill(a, TokenChoice(5))
    assert seq.finished and seq.output_ids == [5] and seq.pending == 0 and b == 1


@pytest.mark.parametrize("hold", [False, True])
def test_warm_up_leaves_nothing_behind(hold):
    """The warm-up workload (a decode engine, and a prefill one that holds blocks after the first token) ends with
    every block free, no prefix cached, counters at zero; the engine then serves as a fresh one does."""
    engine = Engine(EngineConfig(threads=1, dtype="float32", decode_graphs="eager"), hold_after_first=hold)
    engine.warm_up()
    assert engine.blocks.num_free == engine.num_blocks and all(r == 0 for r in engine.blocks.refs)
    assert engine.blocks.num_cached == 0 and engine.blocks.caching and engine.prompt_tokens == 0
    assert not engine.has_work
    fresh = Engine(EngineConfig(threads=1, dtype="float32", decode_graphs="eager", warmup=False), hold_after_first=hold)
    fresh.warm_up()  # off: nothing runs
    assert fresh.runner.graphs.runs == 0
    from engine.generate import generate_many

    if not hold:
        p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert [s.output_ids for _, s in generate_many(engine, ["warm", "up"], [p, p])] == \
            [s.output_ids for _, s in generate_many(fresh, ["warm", "up"], [p, p])]
