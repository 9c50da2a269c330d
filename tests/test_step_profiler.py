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
