"""The nccl transport's checks (bench/nccl_check.py) as two ranks: on two GPUs when they exist, and
always over gloo between two CPU processes (the same protocol code: GRANT, eager sends, draining,
ordering of sends and receives; only the backend differs)."""
import json
import subprocess
import sys

import pytest
import torch


def run_check(tmp_path, *args) -> dict:
    out = tmp_path / "nccl.json"
    subprocess.run([sys.executable, "-m", "bench.nccl_check", "--out", str(out), *args], check=True, timeout=600)
    return json.loads(out.read_text())


def assert_conformant(report, eager=True):
    assert all(report["checks"].values()), report["checks"]
    assert report["size_limit_refused"]
    assert report["placed_staged_bytes"] == 0
    assert not report["aborted_sent"] and report["after-abort_sent"]
    hangup = report["hangup"]
    assert hangup["reported_error"] and hangup["seconds"] < 5 and hangup["world"], hangup
    if eager:
        assert report["drained"] == 1 and report["eager_sends"] > 0
    else:
        assert report["drained"] == 0 and report["eager_sends"] == 0


def test_nccl_protocol_over_gloo(tmp_path):
    assert_conformant(run_check(tmp_path, "--backend", "gloo"))


def test_nccl_protocol_over_gloo_granting_every_transfer(tmp_path):
    assert_conformant(run_check(tmp_path, "--backend", "gloo", "--no-eager"), eager=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl transport needs two CUDA GPUs")
def test_nccl_conformance_on_two_gpus(tmp_path):
    assert_conformant(run_check(tmp_path))
