"""A projection's weights pulled into L2 while the kernels before it wait on latency, not bandwidth (CUDA, sm_80+).

At batch 1 a decode layer reads its weights at the memory bandwidth in
its projections, and between q/k/v and o runs attention: rotary + K/V
store, the split-K attention and its merge, a few microseconds of small
kernels that read a few MB of K/V. Memory sits nearly idle there, and
o's weight (32 MB in bf16, 17 MB in FP8: it fits the H100/H200's 50 MB
L2) is read only after. ``l2(weight)`` launches one short kernel right
after q/k/v whose threads each issue ``prefetch.global.L2`` for a share
of the weight's 128-byte lines and end: the fetches run on in the memory
system while attention runs, and o reads L2. The kernel waits for q/k/v
to finish first (programmatic dependent launch, ``triton_pdl``), so the
prefetch neither slows q/k/v's reads nor is evicted by them. Larger
batches read K/V at the bandwidth during attention: there is nothing to
overlap, so only batches of at most ``MAX_ROWS`` rows prefetch.
``PDSERVE_PREFETCH=0`` turns it off (the A/B); ``PDSERVE_PREFETCH_POLICY``
``last`` marks the lines evict-last."""
from __future__ import annotations

import os

import torch

from .triton_pdl import ENABLED as PDL, launch_options


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PDSERVE_PREFETCH", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


ENABLED = _enabled()
MAX_ROWS = int(os.environ.get("PDSERVE_PREFETCH_ROWS", "4"))
EVICT_LAST = os.environ.get("PDSERVE_PREFETCH_POLICY", "normal") == "last"
LINE = 128  # bytes
LINES = 2048  # per program: 16 a thread at 4 warps

import triton  # noqa: E402 - after the flag: imported only where Triton is
import triton.language as tl  # noqa: E402

from .triton_pdl import wait_then_release  # noqa: E402


@triton.jit
def _prefetch_kernel(ptr, lines, STEP: tl.constexpr, LINES: tl.constexpr, EVICT_LAST: tl.constexpr,
                     PDL: tl.constexpr):
    wait_then_release(PDL)
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    at = ptr + tl.minimum(line, lines - 1).to(tl.int64) * STEP
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [at],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [at], dtype=tl.int32,
                                  is_pure=False, pack=1)


def takes(rows: int) -> bool:
    return ENABLED and rows <= MAX_ROWS


def l2(weight: torch.Tensor) -> None:
    """Start pulling ``weight`` (contiguous, on CUDA) into L2; returns once the fetches are issued."""
    lines = triton.cdiv(weight.numel() * weight.element_size(), LINE)
    _prefetch_kernel[(triton.cdiv(lines, LINES),)](weight, lines, STEP=LINE // weight.element_size(), LINES=LINES,
                                                   EVICT_LAST=EVICT_LAST, PDL=PDL, num_warps=4, **launch_options())
