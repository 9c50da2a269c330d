"""The Triton side of ``engine.parallel.pushed``: a row-parallel projection's tagged stores into every rank's slot
(``push_words``, in ``triton_gemv``'s epilogue) and the pull kernel that waits for every rank's row and sums it.
The protocol is in ``engine.parallel.pushed``."""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_pdl import ENABLED as PDL, launch_options, wait_then_release

SPIN_LIMIT = 1 << 22
BLOCK = 1024  # words a pull program sums


@triton.jit
def tag_of(step_ptr):
    """This step's tag: 1..32767 (the buffer starts at 0, which no step's tag is)."""
    return tl.load(step_ptr) % 32767 + 1


@triton.jit
def push_words(y, push_ptr, step_ptr, site, n, nmask, RANK: tl.constexpr, WORLD: tl.constexpr, CAP: tl.constexpr):
    """Store ``y`` (fp32, channels ``n``) rounded to bf16 and tagged into this rank's row of ``site`` on every rank."""
    bits = y.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    word = (tag_of(step_ptr) << 16) | bits
    for p in tl.static_range(WORLD):
        peer = tl.load(push_ptr + p).to(tl.pointer_type(tl.int32))
        tl.store(peer + (site * WORLD + RANK) * CAP + n, word, mask=nmask)


@triton.jit
def pull_sum(push_ptr, step_ptr, err_ptr, site, k, kmask, RANK: tl.constexpr, WORLD: tl.constexpr,
             CAP: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """The sum over ranks of columns ``k`` of ``site``'s rows in this rank's buffer, polled until every word
    carries this step's tag, in fp32 rounded to bf16 as an all-reduce's output is."""
    mine = tl.load(push_ptr + RANK).to(tl.pointer_type(tl.int32))
    tag = tag_of(step_ptr)
    acc = tl.zeros(k.shape, tl.float32)
    for p in tl.static_range(WORLD):
        row = mine + (site * WORLD + p) * CAP + k
        w = tl.load(row, mask=kmask, other=0, volatile=True)
        missing = tl.sum(((((w >> 16) & 0xFFFF) != tag) & kmask).to(tl.int32), axis=0)
        spins = 0
        while (missing > 0) & (spins < SPIN_LIMIT):
            w = tl.load(row, mask=kmask, other=0, volatile=True)
            missing = tl.sum(((((w >> 16) & 0xFFFF) != tag) & kmask).to(tl.int32), axis=0)
            spins += 1
        if missing > 0:
            tl.store(err_ptr, 1)
        acc += (w & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return acc.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _pull_kernel(push_ptr, step_ptr, err_ptr, out_ptr, site, n, RANK: tl.constexpr, WORLD: tl.constexpr,
                 CAP: tl.constexpr, BLOCK: tl.constexpr, SPIN_LIMIT: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)  # this rank's row is the kernel before's output
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    kmask = k < n
    v = pull_sum(push_ptr, step_ptr, err_ptr, site, k, kmask, RANK, WORLD, CAP, SPIN_LIMIT)
    tl.store(out_ptr + k, v.to(out_ptr.dtype.element_ty), mask=kmask)


def pull(slots, site: int, out) -> None:
    """``out`` (``[1, n]``) = the sum of ``site``'s rows of every rank (``slots``: ``PushSlots``)."""
    n = out.shape[-1]
    _pull_kernel[(triton.cdiv(n, BLOCK),)](slots.buffers, slots.step, slots.error, out, site, n, RANK=slots.rank,
                                            WORLD=slots.world, CAP=slots.cap, BLOCK=BLOCK, SPIN_LIMIT=SPIN_LIMIT,
                                            PDL=PDL, **launch_options())


@triton.jit
def _push_kernel(x_ptr, push_ptr, step_ptr, site, n, RANK: tl.constexpr, WORLD: tl.constexpr, CAP: tl.constexpr,
                 BLOCK: tl.constexpr):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    kmask = k < n
    push_words(tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32), push_ptr, step_ptr, site, k, kmask, RANK,
               WORLD, CAP)


def push_row(slots, site: int, x) -> None:
    """Push ``x`` (``[1, n]``) into ``site`` of every rank as a row-parallel GEMV does (the start-up check, tests)."""
    n = x.shape[-1]
    _push_kernel[(triton.cdiv(n, BLOCK),)](x.contiguous(), slots.buffers, slots.step, site, n, RANK=slots.rank,
                                            WORLD=slots.world, CAP=slots.cap, BLOCK=BLOCK)
