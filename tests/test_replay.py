"""``pdserve bench replay`` on committed slices of the public traces (``tests/data/traces``): both formats read, the
reuse model checked against a count of its own, and a replay against the tiny model whose workers report exactly the
reuse the model predicts when the window fits in the pool."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.reuse import reused_tokens
from planner.traces import TRACE_BLOCK, kind_of, read

DATA = Path(__file__).with_name("data") / "traces"
MOONCAKE, AZURE = DATA / "mooncake_conversation_slice.jsonl", DATA / "azure_code_slice.csv"


def test_both_formats_read_with_arrivals_from_the_first_and_lengths_scaled_by_block():
    assert kind_of(str(MOONCAKE)) == "mooncake" and kind_of(str(AZURE)) == "azure"
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    whole = read(str(MOONCAKE))
    assert len(whole) == 200 and whole[0].arrival_s == 0.0
    assert whole[0].prompt_tokens == first["input_length"] and list(whole[0].blocks) == first["hash_ids"]
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(whole, whole[1:]))
    small = read(str(MOONCAKE), block_size=16, count=20)
    for big, r in zip(whole, small):
        last = big.prompt_tokens - (len(big.blocks) - 1) * TRACE_BLOCK
        assert r.prompt_tokens == (len(big.blocks) - 1) * 16 + -(-last * 16 // TRACE_BLOCK)
        assert r.output_tokens == max(1, -(-big.output_tokens * 16 // TRACE_BLOCK))
    azure = read(str(AZURE), count=50)
    assert azure[0].prompt_tokens == 4808 and azure[0].output_tokens == 10 and len(azure[0].blocks) == 10
    assert abs(azure[1].arrival_s - 0.052) < 1e-3
    assert not set(azure[0].blocks) & set(azure[1].blocks)  # no ids: nothing shared
    assert read(str(MOONCAKE), duration=3.0)[-1].arrival_s <= 3.0


def lru_by_recency(requests, block_size, capacity):
    """The same columns counted another way: a block is cached when fewer than ``capacity`` blocks were touched
    more recently (a request touches its whole blocks in order; the pool is trimmed after each request)."""
    last_touch, clock, out = {}, 0, []
    for req in requests:
        whole = req.blocks[:req.prompt_tokens // block_size]

        def cached(b):
            return b in last_touch and (capacity is None or
                                        sum(t > last_touch[b] for t in last_touch.values()) < capacity)
        hits = next((i for i, b in enumerate(whole) if not cached(b)), len(whole))
        out.append(min(hits * block_size, req.prompt_tokens - 1))
        for b in whole:
            clock += 1
            last_touch[b] = clock
        if capacity is not None:  # what the pool holds after the request: the most recent ``capacity`` blocks
            keep = sorted(last_touch, key=last_touch.get)[-capacity:]
            last_touch = {b: last_touch[b] for b in keep}
    return out


@pytest.mark.parametrize("capacity", [None, 400, 60, 8])
def test_the_ideal_and_lru_columns_match_a_count_of_their_own(capacity):
    requests = read(str(MOONCAKE), block_size=16)
    got = reused_tokens(requests, 16, capacity)
    assert got == lru_by_recency(requests, 16, capacity)
    assert sum(got) > 0 and (capacity is None or sum(got) <= sum(reused_tokens(requests, 16)))


def replay(tmp_path, trace, *extra):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "bench", "replay", str(trace),
                           "--up-args", "--colocated --no-warmup", "--block-size", "16", "--concurrency", "1",
                           "--speed", "1000", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert (out / "replay.md").exists()
    return json.loads((out / "replay.json").read_text())


def test_a_replay_on_the_tiny_model_reuses_what_the_model_says_when_the_window_fits(tmp_path):
    """40 requests of the conversation slice, blocks of 16 tokens, one colocated worker, one request at a time: the
    worker's prefix counters equal the LRU column, which equals the ideal one (the window fits in its pool); a
    second speed gets tokens of its own, so it reuses as much again and no more. ``--count`` counts requests that
    fit; the engine alone, given the first run's prompts, reuses the same tokens and makes the same outputs."""
    report = replay(tmp_path, MOONCAKE, "--count", "40", "--speeds", "1000,2000", "--slo-ttft-ms", "60000",
                    "--engine-alone")
    window = report["window"]
    assert window["requests"] == 40 and window["skipped"] > 0 and window["block_size"] == 16
    requests = read(str(MOONCAKE), block_size=16)
    requests = [r for r in requests if r.prompt_tokens + r.output_tokens <= window["max_context"]][:40]
    want = sum(reused_tokens(requests, 16))
    assert want > 0
    for run in report["runs"]:
        reuse = run["reuse"]
        assert run["summary"]["errors"] == 0 and run["summary"]["requests"] == len(requests)
        assert reuse["lru"]["reused_tokens"] == reuse["ideal"]["reused_tokens"] == want
        assert reuse["workers"]["reused_tokens"] == want, reuse["workers"]
        assert reuse["prompt_tokens"] == reuse["workers"]["computed_tokens"] + want
        assert sum(r["output_tokens"] for r in run["samples"]) == sum(r.output_tokens for r in requests)
    assert report["goodput_speed"] == 2000
    result = report["results"][0]  # what pdserve plan --measured reads: the window's rate at the goodput speed
    assert result["goodput_rate"] == pytest.approx(2000 * 40 / requests[-1].arrival_s, rel=1e-6)
    assert result["workload"] == MOONCAKE.name and result["up_args"] == ["--colocated", "--no-warmup"]
    for rate, run in zip(result["rates"], report["runs"]):  # each run's workers' steps, for plan --calibrate
        (steps,) = rate["step_times"].values()
        assert rate["rate"] == pytest.approx(run["speed"] * 40 / requests[-1].arrival_s, rel=1e-6)
        assert steps["prompt_steps"] > 0 and steps["decode_steps"] + steps["prompt_steps"] >= 40
    from planner.measured import measured_goodputs, shape_of
    (tmp_path / "report.json").write_text(json.dumps(report))
    found = measured_goodputs([str(tmp_path / "report.json")], MOONCAKE.name)
    assert found[shape_of(["--colocated"])]["goodput"] == result["goodput_rate"]
    assert measured_goodputs([str(tmp_path / "report.json")], "another-trace.csv") == {}
    alone = report["engine_alone"]
    assert alone["reused_tokens"] == want and alone["prompt_tokens"] == report["window"]["prompt_tokens"]
    assert alone["output_tokens"] == sum(r.output_tokens for r in requests) and alone["prompt_tok_per_s"] > 0


def test_an_azure_slice_replays_with_nothing_to_reuse(tmp_path):
    report = replay(tmp_path, AZURE, "--count", "12", "--max-context", "600", "--too-long", "clip")
    run = report["runs"][0]
    assert run["summary"]["errors"] == 0 and report["window"]["requests"] == 12
    assert run["reuse"]["ideal"]["reused_tokens"] == run["reuse"]["workers"]["reused_tokens"] == 0


def test_a_trace_written_already_scaled_reads_as_the_scaled_original():
    """``mooncake_conversation_slice_block16.jsonl`` holds the slice's requests that fit 1,024 tokens at 16 tokens a
    block, written scaled: read as recorded at 16 (``--trace-block 16``), they are the original's, scaled."""
    scaled = read(str(DATA / "mooncake_conversation_slice_block16.jsonl"), block_size=16, trace_block=16)
    original = [r for r in read(str(MOONCAKE), block_size=16, count=48) if r.prompt_tokens + r.output_tokens <= 1000]
    assert len(scaled) == 40 and scaled == original[:40]
