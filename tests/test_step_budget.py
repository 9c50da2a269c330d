"""The prompt-token cap of steps that also decode (``engine.step_budget``): the fit of mixed steps, the rows' slack
in their mean time per token, and the engine keeping to the cap without changing its tokens."""
from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.sequence import Sequence
from engine.step_budget import PrefillBudget, StepRecord


def test_the_learned_cap_keeps_the_modelled_step_within_the_slo():
    budget = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=10.0)
    assert budget.tokens() == 256  # nothing measured yet
    for i in range(30):
        budget.observe(StepRecord(8, 0, 4.0))  # decode only: 4 ms
        n = 500 + 100 * (i % 6)
        budget.observe(StepRecord(8, n, 4.0 + 0.02 * n))  # every prompt token adds 20 us
    assert budget.tokens() == pytest.approx(300, abs=2)  # (10 - 4) / 0.02
    budget.observe(StepRecord(0, 4000, 500.0))  # nothing decoded: no TPOT at stake, not learned from
    assert budget.tokens() == pytest.approx(300, abs=2)


def test_learning_measures_a_second_chunk_size_at_the_second_mixed_step():
    """A long prompt chunked at the first cap gives the fit its second size at once, not at its last chunk."""
    budget = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=10.0)
    budget.observe(StepRecord(8, 0, 6.0))
    budget.observe(StepRecord(8, 256, 200.0))  # the first mixed step runs cold: not learned from
    sizes = []
    for _ in range(3):
        n = budget.tokens()
        sizes.append(n)
        budget.observe(StepRecord(8, n, 34.0 + 0.03 * n))  # an eager chunk beside the decode graph (GPU-like)
    assert sizes == [256, 768, 8192]  # then no cap: no chunk keeps a mixed step within 10 ms


def test_with_mixed_step_graphs_the_cap_is_learned_from_steps_the_graphs_replay():
    """As on 2x H200 (Mistral-7B shape, 2026-11-28): a decode step 4.3 ms, a step of up to 1,024 tokens replayed
    from a mixed-step graph 4.5 ms + 22 us a prompt token, a larger one eager at 11.8 ms + 29 us. The probes stay
    within the graphs, so the fit is theirs and the cap keeps a mixed step within 10 ms."""
    budget = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=10.0)
    taken = []
    for _ in range(20):
        budget.observe(StepRecord(12, 0, 4.3))
        n = budget.tokens()
        taken.append(n)
        budget.observe(StepRecord(12, n, 4.5 + 0.022 * n if n + 12 <= 1024 else 11.8 + 0.029 * n))
    assert max(taken) + 12 <= 1024
    assert budget.tokens() == pytest.approx((10.0 - 4.5) / 0.022, abs=2)


def test_where_any_step_with_a_prompt_chunk_breaks_the_slo_prompts_are_not_capped():
    # as measured on an H100 (Mistral-7B shape): a decode step from a CUDA graph 6.5 ms, a step with a prompt
    # chunk an eager forward of ~34 ms plus 30 us a token: no chunk keeps a step within 15 ms, and each mixed step
    # costs the decoding sequences 34 ms, so the fewest mixed steps (no cap) cost their TPOT least
    budget = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=15.0)
    for n in (16, 64, 256, 1024, 16, 300):
        budget.observe(StepRecord(8, 0, 6.5))
        budget.observe(StepRecord(8, n, 34.0 + 0.03 * n))
    assert budget.tokens() == 8192
    info = budget.info()
    assert info["mixed_step_fixed_ms"] == pytest.approx(34.0) and info["step_ms_per_prompt_token"] == pytest.approx(0.03)
    cheap = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=15.0)  # mixed steps of 9 ms + 30 us a token
    for n in (16, 64, 256, 1024, 16, 300):
        cheap.observe(StepRecord(8, 0, 6.5))
        cheap.observe(StepRecord(8, n, 9.0 + 0.03 * n))
    assert cheap.tokens() == pytest.approx((15.0 - 9.0) / 0.03, abs=2)  # capped: within the SLO


def test_a_step_may_take_the_slack_every_decoding_row_has_in_its_mean_time_per_token():
    """TPOT is a mean: a row 10 tokens past its first, 50 ms in, with 100 to come at 5 ms a step, keeps its mean
    within 10 ms with a step of up to 10 x 110 - 50 - 99 x 5 = 555 ms; the tightest row that can still meet the SLO
    decides, a row that cannot is not waited for, and the cap grows to the chunk that fills the allowance."""
    budget = PrefillBudget(ceiling=8192, floor=16, slo_tpot_ms=10.0)
    assert budget.allowance([(10, 50.0, 100)]) is None  # no decode step timed yet
    for n in (500, 600, 700, 800):
        budget.observe(StepRecord(8, 0, 5.0))
        budget.observe(StepRecord(8, n, 5.0 + 0.02 * n))
    assert budget.allowance([(10, 50.0, 100)]) == pytest.approx(555.0)
    assert budget.allowance([(10, 50.0, 100), (60, 500.0, 3)]) == pytest.approx(10 * 63 - 500 - 2 * 5.0)
    assert budget.allowance([(10, 50.0, 100), (60, 900.0, 3)]) == pytest.approx(555.0)  # the second cannot make it
    assert budget.allowance([(60, 900.0, 3)]) is None and budget.allowance([(3, 20.0, 0)]) is None
    assert budget.tokens() == pytest.approx((10 - 5) / 0.02, abs=2)  # the SLO's step
    assert budget.tokens(55.0) == pytest.approx((55 - 5) / 0.02, abs=2)
    assert budget.tokens(1e6) == 8192 and budget.tokens(3.0) == budget.tokens()


def test_a_worker_with_slack_takes_a_prompt_in_larger_chunks_than_the_slo_step():
    """A colocated CPU worker with a TPOT SLO far above its steps: its one decoding row has slack for the whole
    prompt, so the prompt goes in one step even though the SLO's step alone would chunk it."""
    engine = Engine(EngineConfig(device="cpu", dtype="float32", slo_tpot_ms=1000.0, max_batched_tokens=512,
                                 warmup=False))
    budget = engine.prefill_budget
    budget.fit, budget.base_ms = (10.0, 9.9), 5.0  # as if measured: the SLO's step leaves 100 tokens
    assert budget.tokens() == 100
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rows = [Sequence("a", list(range(3, 40)), params, engine.tokenizer, engine.max_len)]
    engine.add(rows[0])
    while rows[0].num_output < 3:
        engine.step()
    budget.fit, budget.base_ms = (10.0, 9.9), 5.0  # the steps just run taught it nothing
    prompt = Sequence("b", [50 + i % 40 for i in range(400)], params, engine.tokenizer, engine.max_len)
    engine.add(prompt)
    out = engine.step()
    assert out.decode_rows == 1 and out.batch_tokens == 1 + 400


def run_engine(cap: int | None, prompts: list[list[int]], max_tokens: int) -> tuple[dict, Engine]:
    engine = Engine(EngineConfig(device="cpu", dtype="float32", step_prefill_tokens=cap, max_batched_tokens=256,
                                 warmup=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    def seq(i, ids):
        return Sequence(f"r{i}", ids, params, engine.tokenizer, engine.max_len)

    seqs = [seq(0, prompts[0])]
    for s in seqs:
        engine.add(s)
    for _ in range(3):  # the first sequence decodes before the long prompts come
        engine.step()
    seqs += [seq(i + 1, ids) for i, ids in enumerate(prompts[1:])]
    for s in seqs[1:]:
        engine.add(s)
    out = {}
    while engine.has_work:
        for s in (tok.seq for tok in engine.step().tokens):
            out[s.rid] = list(s.output_ids)
    return out, engine


def test_steps_that_decode_take_at_most_the_capped_prompt_tokens_and_the_tokens_do_not_change():
    prompts = [list(range(5, 25)), list(range(30, 230)), list(range(3, 163))]
    capped, engine = run_engine(24, prompts, 12)
    plain, reference = run_engine(None, prompts, 12)
    assert capped == plain
    mixed = [r for r in engine.step_log.steps if r.decode_rows and r.prompt_tokens]
    assert mixed and max(r.prompt_tokens for r in mixed) <= 24
    assert engine.step_info()["step_prompt_tokens_max"] <= 24
    assert max(r.prompt_tokens for r in reference.step_log.steps if r.decode_rows) > 24  # the cap made the difference
