"""Fast runs of every bench code path (tiny payloads, few requests)."""
import json

import pytest

from pdserve.cli import main


def test_bench_transfer_tiny(tmp_path):
    out = tmp_path / "t"
    assert main(["bench", "transfer", "--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens", "512", "--transports", "tcp,shm,pickle", "--reps", "2",
                 "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert {"socket", "tcp", "shm", "pickle"} <= set(report["summary"])
    assert len(report["samples"]["tcp"]) == 2 and report["summary"]["tcp"]["gbps"] > 0
    assert (tmp_path / "t.md").read_text().count("|") > 10 and (tmp_path / "t.png").stat().st_size > 1000


def test_bench_serve_against_running_cluster(disagg, tmp_path):
    out = tmp_path / "s"
    assert main(["bench", "serve", "--url", disagg.url, "--requests", "8", "--concurrency", "3", "--prompt-len",
                 "10:40", "--max-tokens", "4:8", "--slo-ttft-ms", "10000", "--slo-stall-ms", "10000",
                 "--warmup-requests", "2", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    s = report["summary"]
    assert s["requests"] == 6 and s["errors"] == 0 and s["goodput_fraction"] == 1.0  # 2 of 8 were the warm-up
    assert s["ttft_ms"]["n"] == 6 and "wire" in s["pdserve_ms"] and s["output_tok_per_s"] > 0
    assert all(4 <= r["output_tokens"] <= 8 for r in report["samples"]) and len(report["samples"]) == 8
    assert all(r["stall_ms"] == max(r["itl_ms"]) and r["itl_p99_ms"] <= r["stall_ms"] for r in report["samples"])
    assert s["stall_ms"]["n"] == 6 and "stall_ms" in (tmp_path / "s.md").read_text()
    # the cluster's engines over the run, from /health: the prefill worker's prompt steps (8 prompts of 10-40
    # tokens), the decode worker's steps, each busy part of the wall time
    workers = s["workers"]
    (prefill,) = [w for key, w in workers.items() if key.startswith("prefill:")]
    (decode,) = [w for key, w in workers.items() if key.startswith("decode:")]
    assert 1 <= prefill["prompt_steps"] <= 8 and 10 <= prefill["prompt_step_tokens"] <= 8 * 40
    assert decode["decode_steps"] >= 3 and all(0 < w["busy"] < 1 for w in (prefill, decode))
    assert "Workers during the run:" in (tmp_path / "s.md").read_text()


def test_bench_serve_poisson_and_chat(disagg, tmp_path):
    assert main(["bench", "serve", "--url", disagg.url, "--endpoint", "chat", "--requests", "4", "--rate", "20",
                 "--max-tokens", "3", "--prompt-len", "8", "--out", str(tmp_path / "p")]) == 0


def test_bench_compare_small(tmp_path):
    out = tmp_path / "c"
    assert main(["bench", "compare", "--transports", "tcp", "--requests", "2", "--rounds", "2", "--prompt-len", "16",
                 "--max-tokens", "4", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert set(report["results"]) == {"colocated", "tcp"}
    assert [len(r["samples"]) for r in report["results"].values()] == [4, 4]
    assert report["results"]["tcp"]["summary"]["pdserve_ms"]["wire"]["median"] > 0
    md = (tmp_path / "c.md").read_text()
    assert "| colocated |" in md and "1.000x, 1.000x" in md and "TTFT client ms" in md


def test_bench_idle_small(tmp_path):
    out = tmp_path / "i"
    assert main(["bench", "idle", "--prompt-len", "32", "--gap-ms", "5", "--reps", "2", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "i.json").read_text())
    assert list(report["summary"]) == ["back to back", "after decode", "after spin", "after sleep"]
    assert all(len(x) == 2 and min(x) > 0 for x in report["samples"].values())
    assert report["summary"]["after decode"]["vs_after_decode"] == 1.0


@pytest.mark.serial
def test_bench_transfer_over_netns_link(tmp_path):
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("netns link emulation needs root")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert main(["bench", "transfer", "--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens", "512", "--transports", "tcp", "--reps", "2", "--warmup", "1",
                 "--link", "netns:1gbit", "--out", str(tmp_path / "n")]) == 0
    report = json.loads((tmp_path / "n.json").read_text())
    assert report["link"] == "netns:1gbit" and len(report["samples"]["tcp"]) == 2
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


def test_bench_transfer_rejects_unknown_link(tmp_path):
    assert main(["bench", "transfer", "--preset", "tiny", "--link", "carrier-pigeon", "--out", str(tmp_path / "x")]) == 2


def test_bench_goodput_small(tmp_path):
    out = tmp_path / "g"
    assert main(["bench", "goodput", "--config", "tcp=--transport tcp", "--rates", "4,8,16", "--requests", "4",
                 "--prompt-len", "16:64", "--max-tokens", "4:8", "--slo-ttft-ms", "20000", "--slo-tpot-ms", "0.001",
                 "--ttft-concurrency", "2", "--warmup-requests", "1", "--min-timed", "3", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "g.json").read_text())
    (result,) = report["results"]
    # nobody meets a 1 us TPOT: goodput 0, and the sweep stops after two rates below half the target
    assert [p["attainment"] for p in result["rates"]] == [0.0, 0.0] and result["goodput_rate"] == 0.0
    assert all(p["errors"] == 0 and p["ttft_ms"]["n"] == 3 == p["timed"] and p["stall_ms"]["n"] == 3
               for p in result["rates"])
    assert result["ttft_under_load"]["2"]["n"] >= 4
    # per rate, the decode worker's step times over that rate alone (from /health): steps ran, gaps measured
    (steps,) = [w for key, w in result["rates"][0]["step_times"].items() if key.startswith("decode:")]
    assert steps["decode_steps"] > 0 and steps["decode_step_ms"] > 0 and steps["gap_ms"] >= 0
    assert 17 <= steps["decode_context_mean"] <= 72  # the tokens a decode row attends to: 16-64 prompt + output so far
    (prompts,) = [w for key, w in result["rates"][0]["step_times"].items() if key.startswith("prefill:")]
    assert prompts["prompt_steps"] > 0 and 16 <= prompts["prompt_step_tokens"] <= 4 * 64  # the prefill worker's too
    assert all(p["waited_idle_s"] is not None for p in result["rates"])  # each rate started from an idle cluster
    point = result["rates"][0]
    assert point["second_token_ms"]["n"] == 3 and point["pdserve_ms"]["wire"]["n"] == 3
    assert "| tcp | 0 |" in (tmp_path / "g.md").read_text()


def test_bench_stream_small(tmp_path):
    out = tmp_path / "st"
    assert main(["bench", "stream", "--prompt-len", "300", "--rounds", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "st.json").read_text())
    assert report["summary"]["bit_exact"] and [t["mode"] for t in report["turns"]] == ["stream", "off"] * 2
    assert all(t["compute_ms"] > 0 and t["transfer_ms"] > 0 for t in report["turns"])


def test_up_spreads_workers_over_gpus():
    from pdserve.cli import _parser
    from deploy.up import plan

    args = _parser().parse_args(["up", "--colocated", "--decode", "3", "--gpus", "2", "--device", "cuda"])
    workers = plan(args)[:-1]
    assert [cmd[cmd.index("--device", cmd.index("--device") + 1) + 1] for cmd in workers] == ["cuda:0", "cuda:1", "cuda:0"]
    assert all(cmd.count("--device") == 1 for cmd in plan(_parser().parse_args(["up", "--decode", "2"]))[:-1])


def test_up_places_the_eight_gpu_cross_tp_layouts_one_gpu_a_rank():
    """Issue 32's run 4 layouts (``bench.tp_handoff.LAYOUTS8``): groups of four and of two side by side on 8 GPUs,
    every rank on a GPU of its own."""
    from bench.tp_handoff import LAYOUTS8
    from pdserve.cli import _parser
    from deploy.up import plan

    def last(cmd, flag):  # a later flag wins, as argparse reads it
        return cmd[len(cmd) - cmd[::-1].index(flag)]

    def gpus(layout):
        cmds = plan(_parser().parse_args(["up", *layout, "--transport", "nccl"]))[:-1]
        return [(cmd[5], int(last(cmd, "--tp")), last(cmd, "--device")) for cmd in cmds]

    assert gpus(LAYOUTS8["prefill-tp4-to-two-decode-tp2"]) == [("prefill", 4, "cuda:0"), ("decode", 2, "cuda:4"),
                                                                ("decode", 2, "cuda:6")]
    assert gpus(LAYOUTS8["two-prefill-tp2-to-decode-tp4"]) == [("prefill", 2, "cuda:0"), ("prefill", 2, "cuda:2"),
                                                               ("decode", 4, "cuda:4")]


def test_bench_kernels_small(tmp_path):
    """Every section runs and gives a time and a fraction of the limits measured in the same run (CPU: the torch
    forms; the checks of decode attention against the fp32 reference pass)."""
    out = tmp_path / "kernels"
    assert main(["bench", "kernels", "--model", "chat-cpu", "--dtype", "float32", "--decode-cases", "1x512,3x100",
                 "--prefill-cases", "2x64", "--tokens", "1,4", "--step-cases", "1x32,3x40-56", "--step-count", "3",
                 "--buffer-mib", "32", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["limits"]["copy_GBps"] > 0 and report["limits"]["matmul_TFLOPs"] > 0
    assert [r["name"] for r in report["decode_attention"]] == ["decode b1 ctx512", "decode b3 ctx100"]
    assert all(r["ok"] and r["of_copy_bw"] > 0 for r in report["decode_attention"])
    assert {r["name"].split()[0] for r in report["layer_kernels"]} == {"rmsnorm", "add_rmsnorm", "silu_mul", "rope_store"}
    assert len(report["gemms"]) == 10 and report["prefill_attention"][0]["of_matmul"] > 0
    steps = {r["name"]: r for r in report["decode_steps"]}
    assert set(steps) == {"step b1 ctx32", "step b3 ctx40-56"} and all(r["over_bound"] > 0 for r in steps.values())
    spread = steps["step b3 ctx40-56"]  # rows of 40, 48 and 56 tokens: their K/V counted one by one
    assert spread["contexts"] == [40, 56] and spread["context"] == 48
    per_token = (spread["bytes"] - steps["step b1 ctx32"]["bytes"]) / (3 * (48 + 3) - (32 + 3))
    assert per_token == int(per_token) > 0
    assert "Whole decode steps" in out.with_suffix(".md").read_text()


def test_bench_router_small(tmp_path):
    out = tmp_path / "router"
    assert main(["bench", "router", "--clients", "1", "--streams", "4", "--max-tokens", "16", "--duration", "2",
                 "--step-ms", "2", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["tokens"] >= 16 and report["errors"] == 0 and report["tokens"] % 16 == 0
    assert report["router_us_per_token"] > 0 and report["tokens_per_event"] >= 1


def test_bench_fp8_small(tmp_path):
    """On the CPU: the KV parts (capacity at one budget, long-context steps, logits agreement); FP8 weights need a GPU."""
    out = tmp_path / "fp8"
    assert main(["bench", "fp8", "--context", "256", "--long-batch", "2", "--decode-steps", "8", "--kv-budget", "2M",
                 "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    capacity = report["capacity"]
    assert capacity["fp8"]["kv_bytes_per_token"] * 2 == capacity["auto"]["kv_bytes_per_token"]
    assert capacity["auto"]["running_at_once"] == capacity["auto"]["blocks_allow"] > 0 and capacity["ratio"] >= 1.9
    assert report["long_context"]["fp8"]["step_ms"] > 0 and min(report["agreement"]["fp8_kv"]) > 0.99


def test_bench_transfer_against_fp8(tmp_path):
    """The same KV as FP8 in the same run: half the bytes, a speed-up reported per transport."""
    out = tmp_path / "fp8"
    assert main(["bench", "transfer", "--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens", "512",
                 "--transports", "tcp", "--reps", "2", "--warmup", "1", "--against-fp8", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["fp8"]["bytes"] * 2 == report["bytes"] and report["fp8"]["layout"]["dtype"] == "float8_e4m3fn"
    assert report["fp8_speedup"]["tcp"]["wire"] > 0 and "FP8" in out.with_suffix(".md").read_text()


def test_bench_guided_small(tmp_path):
    out = tmp_path / "gd"
    assert main(["bench", "guided", "--vocab", "600", "--steps", "20", "--model", "tiny-llama", "--batch", "4",
                 "--prompt-len", "16", "--decode-steps", "8", "--out", str(out)]) == 0
    decode = json.loads((tmp_path / "gd.json").read_text())["decode"]
    assert decode["free"]["tok_per_s"] > 0 and decode["json_schema"]["tok_per_s"] > 0 and "slowdown" in decode
    rows = json.loads((tmp_path / "gd.json").read_text())["rows"]
    assert {(r["engine"], r["grammar"]) for r in rows} >= {("xgrammar", "json_schema"), ("llguidance", "regex")}
    assert all(r["compile_ms"] > 0 and r["fill_accept_us"] > 0 for r in rows) and {r["vocab"] for r in rows} == {259, 600}


def test_bench_pipeline_small(tmp_path):
    out = tmp_path / "pipe"
    assert main(["bench", "pipeline", "--model", "chat-cpu", "--batch", "4", "--prompt-len", "16", "--prefill-len",
                 "48", "--max-batched-tokens", "16", "--decode-steps", "4", "--layouts", "single,pp2",
                 "--out", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads((tmp_path / "pipe.json").read_text())["rows"]}
    assert set(rows) == {"single", "pp2"} and all(r["prefill_ms"] > 0 for r in rows.values())
    hops = rows["pp2"]["decode"][1]["hops"]
    assert [h["hop"] for h in hops] == ["0->1", "1->0"]
    assert all(h["bytes"] == 2 * 512 * 4 and h["wire"] > 0 for h in hops)  # two rows of 512 fp32 a micro-batch
    assert "| 0->1 | 4 |" in (tmp_path / "pipe.md").read_text()


def test_kernel_sweep_shapes_are_one_tp_ranks():
    """``bench kernels --only fused --tp N`` sweeps the projections one rank of a TP=N group runs: q/k/v and gate/up
    split by output (a KV head replicated when there are more ranks than KV heads), o and down by input."""
    from bench.kernels.fused import projection_shapes
    from engine.models.llama import ModelSpec
    from engine.models.presets import preset_config

    mistral = ModelSpec.from_hf(preset_config("mistral-7b"))
    assert projection_shapes(mistral) == {"qkv": (6144, 4096, True, False), "o": (4096, 4096, False, False),
                                          "gate_up": (28672, 4096, True, True), "down": (4096, 14336, False, False)}
    assert projection_shapes(mistral, 2) == {"qkv": (3072, 4096, True, False), "o": (4096, 2048, False, False),
                                             "gate_up": (14336, 4096, True, True), "down": (4096, 7168, False, False)}
    llama70b = ModelSpec.from_hf(preset_config("llama-3-70b"))
    assert projection_shapes(llama70b, 16)["qkv"] == ((4 + 2) * 128, 8192, True, False)


@pytest.mark.parametrize("context", [0, 32])
def test_bench_engine_times_mixed_steps_beside_decode_steps_and_the_chunk_alone(tmp_path, context):
    """Each chunk size has decode-only, mixed and prompt-only steps of exactly its shape, and a fit over the mixed
    ones (on the CPU the figures say little; the bench's GPU runs are in bench/RESULTS.md). With a context, each
    timed step computes only the chunk of a longer prompt: the context before it came from the prefix cache."""
    out = tmp_path / "engine"
    assert main(["bench", "engine", "--batches", "1", "--decode-steps", "4", "--requests", "2", "--input-len", "8:16",
                 "--output-len", "4:8", "--mixed-chunks", "16,64", "--mixed-rows", "3", "--mixed-repeats", "2",
                 "--mixed-context", str(context), "--out", str(out)]) == 0
    mixed = json.loads(out.with_suffix(".json").read_text())["mixed_steps"]
    assert mixed["rows"] == 3 and mixed["context"] == context and [s["chunk"] for s in mixed["sizes"]] == [16, 64]
    assert all(s["steps"] == 2 and min(s["decode_ms"], s["mixed_ms"], s["prompt_ms"]) > 0 for s in mixed["sizes"])
    assert mixed["ms_per_token"] > 0 and mixed["fixed_beyond_decode_ms"] is not None
    report = out.with_suffix(".md").read_text()
    assert "Fit over the mixed steps" in report and (f"after {context} tokens" in report) == bool(context)


def test_mixed_step_summary_fits_the_line_and_the_cost_beyond_running_apart():
    from bench.mixed_step import summarize

    steps = {n: {"decode": [5.0, 5.2, 4.8], "mixed": [9.0 + 0.02 * n] * 2, "alone": [2.0 + 0.02 * n]} for n in (100, 300)}
    result = summarize(8, steps)
    assert result["fixed_ms"] == pytest.approx(9.0) and result["ms_per_token"] == pytest.approx(0.02)
    assert result["fixed_beyond_decode_ms"] == pytest.approx(4.0)
    assert [s["beyond_apart_ms"] for s in result["sizes"]] == [pytest.approx(2.0)] * 2
    with pytest.raises(RuntimeError, match="chunk 100: no mixed step"):
        summarize(8, {100: {"decode": [5.0], "mixed": [], "alone": [2.0]}})


def test_bench_migrate_small(tmp_path):
    """Streams drained off one of two decode workers mid-way: no error, every text as undisturbed, moves reported."""
    from tests.checkpoints import SLOW, write_checkpoint

    out, model = tmp_path / "migrate", write_checkpoint(tmp_path / "slow", SLOW)
    assert main(["bench", "migrate", "--up-args", f"--decode 2 --model {model}", "--streams", "4", "--max-tokens",
                 "300", "--drain-after", "4", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["texts_equal"] == 4 and report["drained"]["errors"] == [] and report["undisturbed"]["errors"] == []
    assert report["drained"]["moves"] and report["drained"]["stall_ms"]["max"] >= 0
    assert set(report["drained"]["tokens"]) == {300}


def test_every_timed_decode_step_decodes_every_row_however_long_the_prompts_took():
    """Eight prompts of 200 tokens through a step budget of 64 take 32 steps to prefill, during which the rows
    admitted first decode: each row gets those steps on top of what the caller asked for, so all eight decode in
    every timed step (before, the first rows ended inside the timed window and a batch-8 row timed fewer)."""
    import random

    from bench.engine import decode_rate, prefill_steps
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(device="cpu", dtype="float32", warmup=False, max_batched_tokens=64))
    assert prefill_steps(engine, [200] * 8) == 8 * 4 + 8
    row = decode_rate(engine, 8, 200, 6, random.Random(0), warmup=2)
    assert row["rows_per_step"] == 8 and row["tokens"] == 8 * 6
    assert 200 < row["context"] < 200 + prefill_steps(engine, [200] * 8) + 8
    assert engine.blocks.num_free == engine.num_blocks


def test_the_llama_3_1_8b_shape_holds_128k_positions_with_llama3_rope_scaling():
    """``--model llama-3.1-8b --load-format dummy``: Llama-3-8B's layers, 131,072 positions, and the llama3 frequency
    scaling (8x past 8,192 positions), which the rotary tables apply: its low frequencies are stretched 8x, its high
    ones kept."""
    from engine.models.llama import ModelSpec
    from engine.models.presets import preset_config
    from engine.models.rope import inv_frequencies

    spec = ModelSpec.from_hf(preset_config("llama-3.1-8b"))
    assert spec.max_position_embeddings == 131072 and spec.rope_scaling["rope_type"] == "llama3"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 32, 8, 128)
    plain = inv_frequencies(128, spec.rope_theta, None)
    scaled = inv_frequencies(128, spec.rope_theta, spec.rope_scaling)
    assert scaled[0] == plain[0] and abs(float(scaled[-1] * 8 / plain[-1]) - 1) < 1e-6
