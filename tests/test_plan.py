"""``pdserve plan``: profiles, the simulation, and the choice between colocation and a prefill/decode split."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.profile import Profile
from planner.search import SLO, Horizon, candidates, rank
from planner.simulate import Instance, Layout, SimRequest, simulate
from planner.workload import lengths


def profile(prefill_ms_per_token: float, decode_base_ms: float = 5.0, tp: int = 1, **extra) -> Profile:
    """A synthetic profile: prefill ``1 ms + per_token x n``; decode ``base + 0.05 ms per sequence + context
    reads``."""
    prefill = [{"tokens": n, "ms": 1.0 + prefill_ms_per_token * n} for n in (128, 1024, 8192)]
    decode = [{"batch": b, "context": c, "step_ms": decode_base_ms + 0.05 * b + 2e-5 * b * c}
              for b in (1, 16, 64, 256) for c in (512, 8192)]
    return Profile(model="synthetic", device="gpu", tp=tp, prefill=prefill, decode=decode,
                   kv_bytes_per_token=131072, **{"kv_capacity_tokens": 1_000_000, **extra})


def test_profiles_interpolate_and_refuse_what_they_are_not():
    p = profile(0.1)
    assert p.prefill_ms(1024) == pytest.approx(103.4)
    assert p.prefill_ms(2048) == pytest.approx(1.0 + 0.1 * 2048)
    assert p.decode_ms(16, 512) == pytest.approx(5.0 + 0.8 + 2e-5 * 16 * 512)
    assert p.decode_ms(40, 4000) == pytest.approx(5.0 + 0.05 * 40 + 2e-5 * 40 * 4000, rel=0.05)
    assert p.kv_transfer_ms(1000, 100.0) == pytest.approx(1.31072)
    with pytest.raises(ValueError, match="version"):
        Profile(**{**p.to_dict(), "version": 99})
    with pytest.raises(ValueError, match="prefill points"):
        Profile(**{**p.to_dict(), "prefill": p.prefill[:1]})


def test_one_request_alone_takes_its_prefill_then_one_step_per_token():
    p = profile(0.1)
    req = simulate(Layout(colocated=[Instance("c0", "colocated", p)]), [SimRequest(0.0, 1024, 11)])[0]
    assert req.ttft_ms == pytest.approx(p.prefill_ms(1024))
    assert req.tpot_ms == pytest.approx(p.decode_ms(1, 1030), rel=0.01)
    split = Layout(prefill=[Instance("p0", "prefill", p)], decode=[Instance("d0", "decode", p)], link_gb_s=10.0)
    req = simulate(split, [SimRequest(0.0, 1024, 11)])[0]
    assert req.ttft_ms == pytest.approx(p.prefill_ms(1024))
    assert req.longest_gap == pytest.approx(p.kv_transfer_ms(1024, 10.0) + p.decode_ms(1, 1025), rel=0.01)


def test_a_capped_instance_takes_a_prompt_whole_while_its_rows_have_slack_and_in_chunks_when_they_do_not():
    """As ``engine.step_budget``: a step may take what the decoding rows' mean TPOT can spare. A row that has just
    begun 200 tokens at ~5 ms has ~1 s to spare at TPOT 10 ms, so a 4,000-token prompt (~400 ms) goes in one step;
    a row 5 tokens from its end that already averages ~9.9 ms holds the step to its slack, and one that cannot spare
    even the SLO's step is not waited for."""
    p = profile(0.1)
    inst = Instance("c0", "colocated", p, slo_tpot_ms=10.0)
    fresh = SimRequest(0.0, 100, 200, tokens=2, first=0.0, last=5.0)
    inst.decoding.append(fresh)
    slo_step = inst.cap(inst.decode_ms())
    assert slo_step < 100
    assert inst.cap(inst.decode_ms(), now=5.0) >= 4000
    tight = SimRequest(0.0, 100, 200, tokens=195, first=0.0, last=1920.0)  # 1990 - 1920 - 4 x 5 = ~50 ms to spare
    inst.decoding.append(tight)
    assert slo_step < inst.cap(inst.decode_ms(), now=1920.0) < 1000
    tighter = SimRequest(0.0, 100, 200, tokens=195, first=0.0, last=1965.0)  # ~5 ms: less than the SLO's step
    inst.decoding[:] = [tighter]
    assert inst.cap(inst.decode_ms(), now=1965.0) == slo_step


def test_a_calibrated_hand_off_delays_the_first_decode_by_its_steps(tmp_path):
    """``handoff_steps`` (fitted from measured second tokens: their p50 less the transfer's phases and one decode
    step, over the step) puts that many of the decode instance's steps between a KV's arrival and its first decode."""
    from planner.calibrate import handoff_steps

    p = profile(0.1, handoff_steps=2.0)
    split = Layout(prefill=[Instance("p0", "prefill", p)], decode=[Instance("d0", "decode", p)], link_gb_s=10.0)
    req = simulate(split, [SimRequest(0.0, 1024, 11)])[0]
    assert req.longest_gap == pytest.approx(p.kv_transfer_ms(1024, 10.0) + 2 * p.decode_ms(1, 1024)
                                            + p.decode_ms(1, 1025), rel=0.01)
    rate = {"second_token_ms": {"median": 30.0}, "pdserve_ms": {"wire": {"median": 4.0}, "serialize": {"median": 1.0}},
            "step_times": {"decode:a": {"decode_step_ms": 5.0, "decode_steps": 500}}}
    report = {"workload": "mixed", "results": [
        {"up_args": ["--transport", "nccl"], "rates": [rate, {**rate, "second_token_ms": {"median": 50.0}},
                                                        {**rate, "second_token_ms": {"median": 20.0}}]},
        {"up_args": ["--colocated", "--decode", "2"], "rates": [{**rate, "second_token_ms": {"median": 500.0}}]}]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert handoff_steps([str(tmp_path / "r.json")], "mixed") == pytest.approx((30 - 5 - 5) / 5)  # the median
    assert handoff_steps([str(tmp_path / "r.json")], "long") is None


SLO_LONG = SLO(ttft_ms=2000.0, tpot_ms=10.0)


def plan(prefill_per_token: float, work) -> list:
    profiles = {1: profile(prefill_per_token, decode_base_ms=8.0)}
    return rank(candidates(2, profiles, SLO_LONG), profiles, work, SLO_LONG, link_gb_s=100.0, local_tokens=512,
                horizon=Horizon(duration_s=20.0, max_requests=600))


def test_where_prefill_interference_dominates_a_split_wins_and_where_it_does_not_colocation():
    work = lengths(100, "3000:4000", "100:200", seed=1)
    cheap = plan(1e-3, work)  # a 4k prompt costs 4 ms: the 2 ms a decode step has to spare take 2k tokens
    assert cheap[0].kind == "colocated", [(c.name, c.goodput) for c in cheap]
    heavy = plan(2.5e-2, work)  # 100 ms: 80 tokens fit a decode step's 2 ms; prompts crawl, or stall decoding
    assert heavy[0].kind == "split", [(c.name, c.goodput) for c in heavy]
    assert heavy[0].goodput > 1.5 * max(c.goodput for c in heavy if c.kind == "colocated")


def test_the_ranking_is_deterministic():
    work = lengths(30, "1000:4000", "50:100", seed=3, workload="mixed")
    first = [(c.name, c.goodput) for c in plan(1e-2, work)]
    assert first == [(c.name, c.goodput) for c in plan(1e-2, work)]
    assert len(first) == 4 and len({name for name, _ in first}) == 4


def test_candidates_cover_tp_degrees_and_splits():
    profiles = {1: profile(1e-3), 2: profile(6e-4, tp=2)}
    names = {c.name for c in candidates(4, profiles, SLO_LONG)}
    assert {"4x colocated tp1", "2x colocated tp2", "1P3D", "3P1D", "1P1D tp2/2", "2P1D tp1/2", "1P2D tp2/1",
            "1P3D auto"} <= names
    waited = {c.name: c for c in candidates(2, {1: profile(1e-3)}, SLO_LONG, waits=(500.0, 50.0))}
    assert sorted(waited) == ["1P1D", "1P1D auto", "1P1D auto wait50", "2x colocated tp1",
                              "2x colocated tp1 capped"]
    up = waited["1P1D auto wait50"].up_command("m", SLO_LONG)
    assert "--disagg auto --disagg-prefill-wait-ms 50 " in up
    assert "--disagg-prefill-wait-ms" not in waited["1P1D auto"].up_command("m", SLO_LONG)
    from planner.measured import shape_of

    assert shape_of(up.split()[2:])[-1] == 50.0 and shape_of("--prefill 1 --decode 1".split())[-1] is None


def test_plan_command_writes_the_recommendation(tmp_path):
    path = tmp_path / "prof.json"
    profile(2.5e-2, decode_base_ms=8.0).save(str(path))
    out = tmp_path / "plan"
    run = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile", str(path), "--gpus", "2",
                          "--prompt-len", "3000:4000", "--max-tokens", "100:200", "--requests", "60",
                          "--duration", "10", "--max-requests", "300",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["recommended"] == report["candidates"][0]["name"] == "1P1D"
    assert "pdserve up --model synthetic" in run.stdout and "recommended:" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile", str(tmp_path / "none.json"),
                          "--gpus", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stdout


def test_bench_engine_measures_a_profile_plan_reads(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "engine", "--batches", "1,4",
                          "--decode-steps", "8", "--requests", "2", "--profile", "--profile-prompts", "32,128",
                          "--profile-contexts", "64", "--threads", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    prof = Profile.load(str(tmp_path / "tiny-profile.json"))
    assert [p["tokens"] for p in prof.prefill] == [32, 128] and {d["batch"] for d in prof.decode} == {1, 4}
    assert prof.model == "tiny-llama" and prof.kv_capacity_tokens > 0
    assert all(d["rows"] == d["batch"] for d in prof.decode)  # every sequence advanced every timed step


def test_the_mixed_workload_is_seven_short_prompts_to_three_long():
    work = lengths(1000, "1", "1", seed=0, workload="mixed")
    long = [p for p, _ in work if p >= 6000]
    assert 0.25 < len(long) / len(work) < 0.35 and all(128 <= p <= 1024 for p, _ in work if p < 6000)
    assert all(128 <= o <= 512 for _, o in work)


def test_validate_measures_the_best_candidate_with_pdserve_up_here(tmp_path):
    path = tmp_path / "cpu.json"
    prof = profile(0.05, decode_base_ms=20.0)
    prof.model, prof.device = "tiny-llama", "cpu"
    prof.save(str(path))
    run = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile", str(path), "--gpus", "1",
                          "--prompt-len", "16:64", "--max-tokens", "4:8", "--slo-ttft-ms", "5000", "--slo-tpot-ms",
                          "500", "--duration", "5", "--max-requests", "100", "--validate", "1",
                          "--validate-requests", "6", "--out", str(tmp_path / "v")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "v.json").read_text())
    assert "--gpus" not in report["candidates"][0]["up"]  # a CPU profile: processes here
    (checked,) = report["validation"]
    assert checked["name"] == report["recommended"] and checked["predicted"] > 0 and checked["rates"]
    assert all(p["errors"] == 0 for p in checked["rates"]) and report["picked_vs_best_measured"] == 1.0


def test_plan_candidates_pair_with_goodput_configurations_by_what_they_run(tmp_path):
    """A bench goodput report's configurations and the plan's candidates match by their pdserve up arguments,
    whatever their names; the pick is judged against the best measured."""
    import json

    from planner.measured import compare, measured_goodputs, shape_of

    assert shape_of("--colocated --decode 4 --gpus 4".split()) == shape_of(
        "--model m --colocated --decode 4 --gpus 4 --max-num-seqs 64".split())
    assert shape_of("--prefill 3 --decode 1 --gpus 4 --transport nccl".split()) != shape_of(
        "--prefill 3 --decode 1 --gpus 4 --transport nccl --disagg auto --slo-tpot-ms 10".split())
    assert shape_of("--colocated --decode 2 --tp 2".split())[3:5] == (2, 2)
    report = {"results": [
        {"name": "4x-colocated", "goodput_rate": 12.0, "up_args": "--colocated --decode 4 --gpus 4 --model m".split()},
        {"name": "3P1D", "goodput_rate": 9.0, "up_args": "--prefill 3 --decode 1 --gpus 4 --transport nccl".split()}]}
    (tmp_path / "g.json").write_text(json.dumps(report))
    ranked = [{"name": "3P1D", "goodput": 14.0, "up": "pdserve up --model m --prefill 3 --decode 1 --gpus 4 "
               "--transport nccl"},
              {"name": "2P2D", "goodput": 10.0, "up": "pdserve up --model m --prefill 2 --decode 2 --gpus 4 "
               "--transport nccl"},
              {"name": "4x colocated tp1", "goodput": 7.0, "up": "pdserve up --model m --colocated --decode 4 --gpus 4"}]
    result = compare(ranked, measured_goodputs([str(tmp_path / "g.json")]))
    assert [r["measured"] for r in result["rows"]] == [9.0, None, 12.0]
    assert result["best_measured"] == "4x colocated tp1" and result["pick_vs_best"] == 0.75


def goodput_report(path, workload, steps):
    """A bench goodput report of one colocated and one 2P2D configuration; ``steps``: per configuration, the
    decode-only step times of its rates as (rows, context, ms)."""
    results = []
    for name, up, goodput in (("4x-colocated", "--colocated --decode 4 --gpus 4", 12.0),
                              ("2P2D", "--prefill 2 --decode 2 --gpus 4 --transport nccl", 18.0)):
        rates = [{"rate": 6.0, "step_times": {f"{'colocated' if 'colocated' in up else 'decode'}:tcp://w{i}": {
            "decode_steps": 500, "decode_step_ms": ms, "decode_rows_mean": rows, "decode_context_mean": context}
            for i, (rows, context, ms) in enumerate(steps[name])}}]
        results.append({"name": name, "workload": workload, "goodput_rate": goodput, "up_args": up.split(),
                        "rates": rates})
    path.write_text(json.dumps({"results": results, "workload": workload}))
    return str(path)


def test_measured_goodputs_are_those_of_the_workload_planned(tmp_path):
    from planner.measured import measured_goodputs

    none = {"4x-colocated": [], "2P2D": []}
    mixed = goodput_report(tmp_path / "m.json", "mixed", none)
    long = json.loads((tmp_path / "m.json").read_text())
    for r in long["results"]:
        r["workload"], r["goodput_rate"] = "long", r["goodput_rate"] / 2
    (tmp_path / "l.json").write_text(json.dumps(long))
    got = measured_goodputs([str(tmp_path / "l.json"), mixed], "long")
    assert sorted(m["goodput"] for m in got.values()) == [6.0, 9.0]
    assert sorted(m["goodput"] for m in measured_goodputs([str(tmp_path / "l.json"), mixed], "mixed").values()) == [
        12.0, 18.0]
    finer = json.loads((tmp_path / "m.json").read_text())  # a second run at rates above: one met nothing
    finer["results"][0]["goodput_rate"], finer["results"][1]["goodput_rate"] = 0.0, 20.0
    (tmp_path / "f.json").write_text(json.dumps(finer))
    both = measured_goodputs([mixed, str(tmp_path / "f.json")], "mixed")
    assert sorted((m["goodput"], m["report"].endswith("f.json")) for m in both.values()) == [(12.0, False),
                                                                                           (20.0, True)]


def test_a_kv_read_rate_puts_a_floor_under_long_context_decode_steps():
    p = profile(0.1)
    fast = p.decode_ms(32, 8192)
    assert fast == pytest.approx(5.0 + 0.05 * 32 + 2e-5 * 32 * 8192)
    p.kv_read_gb_s = 1000.0  # 32 x 7,680 more tokens of 128 KiB: 32.2 GB at 1 TB/s
    floor = p.measured_decode_ms(32, 512) + 32 * (8192 - 512) * 131072 / 1e9
    assert p.decode_ms(32, 8192) == pytest.approx(floor) and floor > fast
    assert p.decode_ms(32, 512) == pytest.approx(p.measured_decode_ms(32, 512))  # the shortest context: as profiled
    with pytest.raises(ValueError, match="kv_read_gb_s"):
        Profile(**{**p.to_dict(), "kv_read_gb_s": 0})


def test_calibration_fits_the_read_rate_that_explains_serving_steps(tmp_path):
    """Steps made at a known K/V read rate beyond the profile's are fitted back to it, the plan uses it, and
    --calibrate refuses reports with nothing to fit."""
    from planner.calibrate import kv_read_gb_s, points, row_context

    prof = profile(0.1)
    rate = 2000.0  # GB/s

    def step(rows, context):
        return rows, context, prof.measured_decode_ms(rows, 512) + rows * (context - 512) * 131072 / (rate * 1e6)

    steps = {"4x-colocated": [step(6, 2700), step(9, 2900)], "2P2D": [step(16, 2600), step(24, 2800)]}
    path = goodput_report(tmp_path / "g.json", "mixed", steps)
    found = points([path], "mixed")
    assert len(found) == 4 and points([path], "long") == []
    assert kv_read_gb_s({1: prof}, found) == pytest.approx(rate)
    assert 2000 < row_context("mixed") < 3500 and 6500 < row_context("long") < 7500

    prof.save(str(tmp_path / "p.json"))
    run = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile", str(tmp_path / "p.json"), "--gpus",
                          "2", "--workload", "mixed", "--requests", "60", "--measured", path, "--calibrate",
                          "--duration", "5", "--max-requests", "60", "--out", str(tmp_path / "plan"),
                          "--save-profile", str(tmp_path / "calibrated.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "read K/V at 2,000 GB/s" in run.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["calibration"]["kv_read_gb_s"] == pytest.approx(rate)
    assert Profile.load(str(tmp_path / "calibrated.json")).kv_read_gb_s == pytest.approx(rate)  # --roles-profile's
    flat = goodput_report(tmp_path / "f.json", "mixed", {"4x-colocated": [(4, 512, 1.0)], "2P2D": []})
    bad = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile", str(tmp_path / "p.json"), "--gpus",
                          "4", "--measured", flat, "--calibrate"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "nothing to fit" in bad.stdout


@pytest.mark.parametrize("wait_ms,local", [(0.0, 4), (500.0, 0), (100.0, 1)])
def test_auto_goes_local_when_the_prefill_backlog_takes_long_not_when_it_holds_many_prompts(wait_ms, local):
    """Eight 600-token prompts at once on 1P1D auto: the fifth and later find four prompts in flight, a busy
    prefill instance by count; by time their backlog is 2.4k-4.2k tokens at 0.025 ms a token, ~61-106 ms (only the
    eighth waits 100 ms or more)."""
    p = profile(0.025)
    split = Layout(prefill=[Instance("p0", "prefill", p)], decode=[Instance("d0", "decode", p)], link_gb_s=10.0,
                   local_tokens=512, prefill_wait_ms=wait_ms)
    reqs = simulate(split, [SimRequest(0.0, 600, 8) for _ in range(8)])
    assert sum(r.local for r in reqs) == local and all(r.finish is not None for r in reqs)


def test_prefill_workers_steps_under_load_scale_the_profiles_prompt_time(tmp_path):
    """A prefill worker's prompt steps 1.2x the profile's of as many tokens (1P1D at 32 streams on 2x H100: 30 us a
    token against the engine's 25) set ``prefill_scale``; a rate with too few steps does not count."""
    from planner.calibrate import prefill_points, prefill_scale

    prof = profile(0.025)
    alone = prof.prefill_ms(1588)
    rates = [{"step_times": {"prefill:tcp://a": {"prompt_steps": 124, "prompt_step_tokens": 1588,
                                                  "prompt_step_ms": 1.2 * alone},
                             "decode:tcp://b": {"decode_steps": 900, "prompt_steps": 0}}},
             {"step_times": {"prefill:tcp://a": {"prompt_steps": 3, "prompt_step_tokens": 512,
                                                  "prompt_step_ms": 90.0}}}]
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"workload": "mixed", "results": [
        {"up_args": ["--prefill", "1", "--decode", "1", "--transport", "nccl"], "rates": rates}]}))
    found = prefill_points([str(path)], "mixed")
    assert found == [{"tokens": 1588, "ms": pytest.approx(1.2 * alone), "steps": 124, "tp": 1}]
    prof.prefill_scale = prefill_scale({1: prof}, found)
    assert prof.prefill_scale == pytest.approx(1.2) and prof.prefill_ms(1588) == pytest.approx(1.2 * alone)
    req = simulate(Layout(colocated=[Instance("c0", "colocated", prof)]), [SimRequest(0.0, 1588, 2)])[0]
    assert req.ttft_ms == pytest.approx(1.2 * alone)
    assert prefill_points([str(path)], "long") == []


def test_the_shifting_workload_is_simulated_in_phases_of_seconds_at_every_rate():
    """``bench goodput --workload shifting`` sends phases of ``SHIFT_S`` seconds of arrivals; the planner simulates the
    same at each rate it tries (it cycled phases of 64 requests, seconds long at high rates, and so averaged the
    prompt-heavy phase away)."""
    from planner.cli import shifting_at
    from planner.search import workload_requests
    from planner.workload import SHIFT_S, SHIFTING

    for rate in (4.0, 30.0):
        reqs = workload_requests(shifting_at, rate, 0, Horizon(2 * SHIFT_S, 10_000))
        assert len(reqs) == int(rate * 2 * SHIFT_S)
        heavy = reqs[:int(rate * SHIFT_S)]
        light = reqs[int(rate * SHIFT_S):]
        assert all(SHIFTING[0][0][0] <= r.prompt <= SHIFTING[0][0][1] for r in heavy)
        assert all(SHIFTING[1][0][0] <= r.prompt <= SHIFTING[1][0][1] for r in light)


def test_tiers_buy_reuse_as_the_lru_model_counts_it_and_save_prefill():
    """``pdserve plan --tier-gb``: each size's capacity is the pool's plus the tier's blocks, its reuse the LRU
    model's at that capacity, and more memory never computes more."""
    from pathlib import Path

    from planner import tiers
    from planner.reuse import reused_tokens
    from planner.traces import read

    requests = read(str(Path(__file__).with_name("data") / "traces" / "mooncake_conversation_slice.jsonl"))
    prof = profile(0.05, kv_capacity_tokens=512 * 20)  # a pool of 20 trace blocks
    rows = tiers.tier_rows(requests, prof, [0, 0.5, 5], 512, 50.0)
    assert [r["capacity_blocks"] for r in rows] == [20, 20 + int(0.5e9 / 131072) // 512, 20 + int(5e9 / 131072) // 512]
    for r in rows:
        want = sum(reused_tokens(requests, 512, r["capacity_blocks"])) / sum(q.prompt_tokens for q in requests)
        assert r["reused_share"] == pytest.approx(want)
    assert rows[0]["reused_share"] < rows[2]["reused_share"]
    assert rows[0]["prefill_gpu_s"] > rows[1]["prefill_gpu_s"] >= rows[2]["prefill_gpu_s"]
    assert "| 0.5 |" in tiers.table(rows, 512)


def test_a_trace_is_simulated_at_its_own_arrival_times_sped_up_and_its_bursts_cost_what_poisson_hides():
    """A trace's window keeps its arrivals (``planner.traces.TraceWindow``): at a rate of k times its own, every
    arrival comes k times sooner, as ``bench replay --speed k`` sends them, and every request is counted. A window of
    bursts (ten prompts at once, then a lull) meets the SLOs at a lower rate than Poisson arrivals of the same
    requests at the same mean rate."""
    from planner.search import attainment, goodput, workload_requests
    from planner.traces import TraceRequest, TraceWindow

    rows = [TraceRequest(10.0 * (i // 10) + 0.01 * (i % 10), 2000, 20, ()) for i in range(40)]  # 10 at once, 10 s apart
    window = TraceWindow(tuple(rows))
    assert window.rate == pytest.approx(40 / 30.09)
    reqs = workload_requests(window, 2 * window.rate, seed=0)
    assert [r.arrival for r in reqs] == pytest.approx([r.arrival_s * 1e3 / 2 for r in rows])
    assert [(r.prompt, r.output) for r in reqs] == [(2000, 20)] * 40
    slo, prof = SLO(ttft_ms=2000, tpot_ms=25), {1: profile(2.5e-2)}
    colocated = candidates(1, prof, slo)[0]
    assert colocated.kind == "colocated"
    done = simulate(colocated.layout(prof, 50.0, 0), workload_requests(window, window.rate, 0))
    assert attainment(done, slo, window) == sum(r.ttft_ms <= 2000 and r.tpot_ms <= 25 for r in done) / 40
    bursty = goodput(colocated, prof, window, slo, 50.0, 0)
    smooth = goodput(colocated, prof, [(2000, 20)] * 40, slo, 50.0, 0, horizon=Horizon(30, 2000))
    assert 0 < bursty < smooth / 2
