"""The nccl transport's checks run as two ranks on two GPUs (bench/nccl_check.py); here when GPUs exist."""
import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl transport needs two CUDA GPUs")


def test_nccl_conformance_on_two_gpus(tmp_path):
    out = tmp_path / "nccl.json"
    subprocess.run([sys.executable, "-m", "bench.nccl_check", "--out", str(out)], check=True, timeout=600)
    report = json.loads(out.read_text())
    assert all(report["checks"].values()), report["checks"]
    assert report["size_limit_refused"]
