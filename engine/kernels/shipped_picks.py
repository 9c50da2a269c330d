"""Tile picks that a sweep measured on one kind of GPU, shipped with the code and used there by default.

``engine/kernels/picks/<kernel>-<gpu>.json`` (``gemv-h100.json``; the GPU's model from its name: ``NVIDIA H100
80GB HBM3`` -> ``h100``) holds what ``pdserve bench kernels --sweep`` wrote as ``<out>-picks.json`` for that
kernel, merged over the model shapes swept (keys name the shapes, so one file serves every model and TP degree).
An environment variable naming a file (``PDSERVE_GEMV_CONFIGS``, ``PDSERVE_FEWROW_CONFIGS``) is used instead."""
from __future__ import annotations

import os
import re
from pathlib import Path

DIR = Path(__file__).with_name("picks")


def gpu_model(name: str) -> str:
    """``h100`` from ``NVIDIA H100 80GB HBM3``, ``a100`` from ``NVIDIA A100-SXM4-80GB``; empty if none is named."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.replace("-", " "))
    return m.group(1).lower() if m else ""


def path_for(kernel: str, device_name: str | None = None) -> str | None:
    """The shipped picks of ``kernel`` for this GPU (``device_name``: the current CUDA device's), or None."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    model = gpu_model(device_name)
    path = DIR / f"{kernel}-{model}.json"
    return str(path) if model and path.exists() else None


_loaded: set[str] = set()  # kernels whose shipped picks were looked up


def load_once(kernel: str, env: str, load) -> None:
    """The first time ``kernel``'s tiles are asked for: ``load(path)`` of its shipped picks for this GPU (a path or
    None), unless ``env`` names a file of picks (loaded by the kernel itself)."""
    if kernel in _loaded:
        return
    _loaded.add(kernel)
    if not os.environ.get(env):
        load(path_for(kernel))
