"""bench goodput's rate search, named workloads and the give-up rule (requests that can no longer meet the SLO are
cancelled: they count as misses and their KV is freed on the server)."""
import argparse
import asyncio
import json
import time
import urllib.request

import pytest

from bench.goodput import give_up_s, rates_to_try, workloads_of
from bench.health import wait_idle
from bench.serve import run_load
from planner.workload import lengths, longest_output


def _tried(capacity, **kw):
    args = argparse.Namespace(attainment=0.9, rates="1,2,4,8,16,32", **kw)
    seen = []

    def probe(rate):
        seen.append(rate)
        return 1.0 if rate <= capacity else 0.2

    rates_to_try(args, probe)
    return seen


def test_search_doubles_while_met_then_bisects():
    assert _tried(10, search=4.0, probes=5) == [4.0, 8.0, 16.0, 12.0, 10.0]
    assert _tried(1, search=4.0, probes=4) == [4.0, 2.0, 1.0, 1.5]  # missed first: halve, then bisect


def test_fixed_rates_stop_after_two_below_half_the_target():
    assert _tried(3) == [1.0, 2.0, 4.0, 8.0]


def test_named_workloads_and_the_longest_output():
    assert all(6000 <= p <= 8000 and 128 <= o <= 256 for p, o in lengths(50, "1", "1", workload="long"))
    assert all(1000 <= p <= 4000 and 128 <= o <= 512 for p, o in lengths(50, "1", "1", workload="mid"))
    assert [longest_output(w, "4:9") for w in ("uniform", "mid", "long", "mixed")] == [9, 512, 256, 512]
    assert workloads_of(argparse.Namespace(workload="mid,long")) == ["mid", "long"]
    args = argparse.Namespace(slo_ttft_ms=2000.0, slo_tpot_ms=10.0, max_tokens="1")
    assert give_up_s(args, "long") == pytest.approx(2.0 + 2.56 + 2.0)


def _decode_pools(url):
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        workers = json.loads(r.read())["workers"]
    return [(w["kv_blocks"], w["kv_blocks_free"], w["outstanding"]) for w in workers["decode"]]


def test_requests_past_the_give_up_time_are_cancelled_and_free_their_kv(disagg):
    ns = argparse.Namespace(url=disagg.url, model=None, endpoint="completions", requests=6, duration=None,
                            concurrency=100, rate=50.0, prompt_len="200", max_tokens="400", prompts_jsonl=None,
                            temperature=0.0, seed=3, workload="uniform", give_up_s=0.0)
    rows, _ = asyncio.run(run_load(ns))
    gave_up = [r for r in rows if (r["error"] or "").startswith("abandoned")]
    assert len(rows) == 6 and gave_up and sorted(r["index"] for r in rows) == list(range(6))
    assert wait_idle(disagg.url, 20) is not None  # no worker keeps working for a request given up
    end = time.monotonic() + 15  # a cancelled transfer still landing holds its blocks until it is torn down
    while not all(free == total and not busy for total, free, busy in _decode_pools(disagg.url)):
        assert time.monotonic() < end, f"decode KV not all free: {_decode_pools(disagg.url)}"
        time.sleep(0.2)


def test_each_rate_gets_its_own_prompts_so_none_hits_the_prefix_cache():
    from bench.goodput import probe_seed
    from planner.workload import build

    def prompts(workload, rate):
        return [r.prompt for r in build(40, "200:300", "4", probe_seed(0, workload, rate), workload=workload)]

    a, b = prompts("long", 4.0), prompts("long", 8.0)
    assert a == prompts("long", 4.0)  # the same rate: the same requests (every configuration sees them)
    heads = {p[:48] for p in a}
    assert len(heads) == len(a) and not heads & {p[:48] for p in b} and not heads & {p[:48] for p in
                                                                                   prompts("mixed", 4.0)}


def test_a_rates_step_times_carry_the_prompt_cap_as_the_rate_left_it():
    from bench.health import step_delta

    before = {"colocated:a": {"decode_steps": 10, "decode_ms": 60.0, "prompt_steps": 1, "prompt_ms": 30.0}}
    after = {"colocated:a": {"decode_steps": 20, "decode_ms": 130.0, "prompt_steps": 3, "prompt_ms": 100.0,
                             "step_prefill_cap": 256, "mixed_step_fixed_ms": 7.5, "step_base_ms": None}}
    (w,) = step_delta(before, after).values()
    assert w["decode_step_ms"] == 7.0 and w["prompt_step_ms"] == 35.0
    assert w["step_prefill_cap"] == 256 and w["mixed_step_fixed_ms"] == 7.5 and "step_base_ms" not in w


def test_a_low_rate_runs_long_enough_to_count_min_timed_requests():
    from types import SimpleNamespace

    from bench.goodput import probe_length

    args = SimpleNamespace(requests=200, duration=18.0, warmup_requests=4, min_timed=20)
    assert probe_length(args, 10.0) == (200, 18.0)  # 180 arrivals: plenty
    assert probe_length(args, 0.5) == (200, 48.0)  # 24 arrivals (4 warm-up + 20 counted) need 48 s at 0.5/s
    args.min_timed = 0
    assert probe_length(args, 0.5) == (200, 18.0)
    args.duration, args.min_timed = None, 20
    assert probe_length(args, 0.5) == (200, None) and probe_length(SimpleNamespace(
        requests=8, duration=None, warmup_requests=4, min_timed=20), 1.0) == (24, None)


def test_the_shifting_workload_alternates_prompt_heavy_and_generation_heavy_phases_by_arrival_time():
    from planner.workload import SHIFT_S, lengths, longest_output

    rate = 2.0
    rows = lengths(int(4 * SHIFT_S * rate), "1", "1", seed=3, workload="shifting", rate=rate)
    per_phase = int(SHIFT_S * rate)
    for phase in range(4):
        part = rows[phase * per_phase:(phase + 1) * per_phase]
        heavy_prompts = phase % 2 == 0
        assert all((p >= 3000 and o <= 64) if heavy_prompts else (p <= 256 and o >= 256) for p, o in part)
    assert longest_output("shifting", "1") == 512
    assert lengths(10, "1", "1", seed=3, workload="shifting", rate=rate) == rows[:10]  # seeded: the same everywhere
