"""What the Triton kernel tests share: Triton's interpreter where there is no GPU (``TRITON_INTERPRET=1``, read when
the kernels are defined, so this module is imported before any of them), the device the tensors go to, and the mark
that skips a module where triton is missing."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
