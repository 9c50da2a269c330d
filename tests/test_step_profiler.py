"""A window of engine steps under the torch profiler (``PDSERVE_PROFILE_STEPS``): in the engine, and from the
workers of ``pdserve up``."""
from __future__ import annotations

import glob
import gzip
import json
import os

import httpx
import pytest

from deploy.local import Cluster
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from engine.step_profiler import StepProfiler, from_env


def test_the_window_of_steps_is_profiled_and_summarized(tmp_path):
    engine = Engine(EngineConfig(device="cpu", threads=1))
    engine.profiler = StepProfiler(2, 3, str(tmp_path), "test")
    prompts = [engine.tokenizer.encode(f"prompt number {i}") for i in range(3)]
    generate_many(engine, prompts, [SamplingParams(max_tokens=8, temperature=0) for _ in prompts])
    (path,) = glob.glob(str(tmp_path / f"test-{os.getpid()}-steps2-4.json"))
    summary = json.loads(open(path).read())
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
    assert all(s["wall_ms"] > 0 and s["profiled_ms"] >= s["device_busy_ms"] == 0 for s in summary["steps"])
    assert summary["host_bound_share"] is None  # no kernels on the CPU: nothing to compare the host with
    assert summary["top_host_self"] and summary["top_host_self"][0]["ms"] > 0
    trace = json.loads(gzip.open(path.replace(".json", ".trace.json.gz")).read())
    assert sum(e.get("name") == "pdserve_step" for e in trace["traceEvents"]) == 3
    assert engine.profiler.done  # once: later steps run unprofiled


def test_a_bad_window_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_PROFILE_STEPS", "10")
    with pytest.raises(ValueError, match="START:COUNT"):
        from_env("decode")
    monkeypatch.setenv("PDSERVE_PROFILE_STEPS", "3:0")
    with pytest.raises(ValueError, match="COUNT >= 1"):
        from_env("decode")
    monkeypatch.delenv("PDSERVE_PROFILE_STEPS")
    assert from_env("decode") is None


def test_up_workers_profile_their_steps_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PROFILE_STEPS", "1:2")
    monkeypatch.setenv("PDSERVE_PROFILE_DIR", str(tmp_path))
    cluster = Cluster().wait_ready()
    try:
        for i in range(3):
            r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                           json={"model": "tiny-llama", "prompt": f"profile me {i}", "max_tokens": 6})
            assert r.status_code == 200
    finally:
        cluster.stop()
    for role in ("prefill", "decode"):
        (path,) = glob.glob(str(tmp_path / f"{role}-*-steps1-2.json"))
        assert len(json.loads(open(path).read())["steps"]) == 2


def test_a_steps_device_time_is_the_union_of_its_kernels_and_idle_steps_are_left_out():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from engine.step_profiler import summarize

    def ev(name, start, end, device=DeviceType.CUDA, self_us=0.0):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               self_cpu_time_total=self_us)

    events = [ev("pdserve_step", 0, 10_000, DeviceType.CPU), ev("pdserve_step", 12_000, 20_000, DeviceType.CPU),
              ev("gemm", 1_000, 4_000), ev("gemm", 3_000, 6_000), ev("attn", 9_000, 13_000),  # overlaps both steps
              ev("aten::mm", 0, 500, DeviceType.CPU, self_us=400.0)]
    s = summarize(events + [ev("pdserve_step", 10_200, 10_300, DeviceType.CPU)], [10.5, 8.2], [True, False, True])
    assert [(r["wall_ms"], r["device_busy_ms"], r["kernels"]) for r in s["steps"]] == [(10.5, 6.0, 3), (8.2, 1.0, 1)]
    assert s["host_bound_share"] == pytest.approx(1 - 7 / 18, abs=1e-4)
    assert s["top_device"][0] == {"name": "gemm", "ms": 6.0, "calls": 2}
    assert s["top_host_self"] == [{"name": "aten::mm", "ms": 0.4, "calls": 1}]
