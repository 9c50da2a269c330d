"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's Triton kernels (attention, the
one-row GEMV, norms, SiLU-times-up, the FP8 quantization and GEMM).

A kernel launched with PDL may be scheduled while the kernel before it in
the stream is still running; it waits (``griddepcontrol.wait``: until the
kernels before it have completed and their writes are visible) before its
first read of their output, and lets the next kernel be scheduled
(``griddepcontrol.launch_dependents``) once its own loads are issued. In a
decode step of a few rows every kernel is short, so the gap between one
kernel's end and the next one's start (1-2 us, as long as a small kernel)
is most of what the launches cost; PDL hides it. Inside a CUDA graph the
launches become programmatic edges. Kernels launched without it (torch's,
cuBLAS) keep the plain order, so mixing is safe. The interpreter and GPUs
before Hopper never use it."""
from __future__ import annotations

import os

import torch


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


ENABLED = _enabled()


def launch_options() -> dict:
    """The launch keyword for a kernel that takes ``PDL=ENABLED`` (and waits when it is set)."""
    return {"launch_pdl": True} if ENABLED else {}


import triton  # noqa: E402 - after the flag: this module is imported by the Triton kernel modules only
import triton.language as tl  # noqa: E402


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """At a kernel's start: wait for the kernels before (their output is this one's input), then let the next one
    launch (it waits in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
