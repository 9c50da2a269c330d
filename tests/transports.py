"""Which transports this machine can run, for the conformance suite."""
from __future__ import annotations

import importlib.util

import pytest

CPU_TRANSPORTS = ["tcp", "shm", "pickle"]
OPTIONAL = {"ray": "ray", "mlx": "mlx", "nixl": "nixl"}


def available() -> list:
    params = [pytest.param(n, id=n) for n in CPU_TRANSPORTS]
    for name, module in OPTIONAL.items():
        missing = importlib.util.find_spec(module) is None
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(missing, reason=f"{module} not installed")))
    params.append(pytest.param("nccl", id="nccl", marks=pytest.mark.skip(reason="nccl needs two CUDA GPUs; run on the device tool")))
    return params
