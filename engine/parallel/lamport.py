"""A one-shot all-reduce without barriers for a TP group's small tensors on GPUs (``PDSERVE_TP_ALLREDUCE=lamport``).

Every rank holds a symmetric buffer (``torch.distributed._symmetric_memory``: each rank can address every peer's
over NVLink) of three slots, each a row of ``cap`` 16-bit words per rank, all set to a sentinel (``0x8000``: the
bits of -0.0 in bf16 and fp16) once at start-up. A call:

1. each program of a fixed grid reads its own ticket ``t`` (a per-program counter in local memory: every program
   of every rank counts the same calls, so they agree on ``slot = t % 3`` without talking);
2. writes its share of the input, -0.0 made +0.0 so no value is the sentinel, into ``slot``'s row for this rank in
   every rank's buffer (its own too);
3. reads its own buffer's ``slot`` rows, one per rank, again until no word is the sentinel: each word arrives whole,
   so a word that is not the sentinel is the peer's value; sums them in fp32, writes the output, and sets each row
   it has read back to the sentinel. No peer writes that slot again before the call after next (three slots), and
   a peer's next call needs this rank's next push, which comes after this kernel ends; the rows cleared are the
   ones written, whatever size the next call in that slot has.

So a call costs one NVLink write and the reads, with no barrier round trips; NCCL-free and graph-safe, launched
with programmatic dependent launch (Hopper) like the decode step's other kernels, so the projection after it
fetches its first weights while it waits on the peers (the slot
comes from device memory, not from the launch). A read that never completes (a peer gone) gives up after
``SPIN_LIMIT`` polls and raises the error flag, which the start-up check against NCCL reads. Under Triton's
interpreter (CI) ``PHASES`` runs the push and the pull as separate launches, so one process can play every rank in
turn (``tests/test_lamport.py``); the engine launches both in one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.triton_pdl import ENABLED as PDL, launch_options, wait_then_release

SENTINEL = -32768  # 0x8000 as int16
_SENTINEL = tl.constexpr(SENTINEL)  # the kernel's view of it
GRID = 32  # programs of every call (fixed: each program's ticket counts every call)
BLOCK = 1024  # words a program moves per iteration
SPIN_LIMIT = 1 << 22


@triton.jit
def _lamport_kernel(inp_ptr, out_ptr, ptrs_ptr, ticket_ptr, err_ptr, n, RANK: tl.constexpr, WORLD: tl.constexpr,
                    CAP: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr, PHASES: tl.constexpr,
                    SPIN_LIMIT: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)  # the input is the kernel before's output; the next kernel may fetch its weights now
    pid = tl.program_id(0)
    t = tl.load(ticket_ptr + pid)
    slot = t % 3
    mine = tl.load(ptrs_ptr + RANK).to(tl.pointer_type(tl.int16))
    if PHASES % 2 == 1:  # push this rank's share into every rank's slot row for it: all chunks first, so the
        for start in range(pid * BLOCK, n, GRID * BLOCK):  # pulls below wait on one NVLink latency, not one a chunk
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            bits = tl.load(inp_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True)
            bits = tl.where(bits == _SENTINEL, 0, bits).to(tl.int16)
            for p in tl.static_range(WORLD):
                peer = tl.load(ptrs_ptr + p).to(tl.pointer_type(tl.int16))
                tl.store(peer + (slot * WORLD + RANK) * CAP + offs, bits, mask=mask)
    if PHASES >= 2:  # pull every rank's row, sum, clear what was read
        for start in range(pid * BLOCK, n, GRID * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            acc = tl.zeros([BLOCK], tl.float32)
            for p in tl.static_range(WORLD):
                row = mine + (slot * WORLD + p) * CAP + offs
                v = tl.load(row, mask=mask, other=0, volatile=True)
                missing = tl.sum(((v == _SENTINEL) & mask).to(tl.int32), axis=0)
                spins = 0
                while (missing > 0) & (spins < SPIN_LIMIT):
                    v = tl.load(row, mask=mask, other=0, volatile=True)
                    missing = tl.sum(((v == _SENTINEL) & mask).to(tl.int32), axis=0)
                    spins += 1
                if missing > 0:
                    tl.store(err_ptr, 1)
                acc += v.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
                tl.store(row, tl.full([BLOCK], _SENTINEL, tl.int16), mask=mask)  # read: the row is free again
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if PHASES >= 2:
        tl.store(ticket_ptr + pid, t + 1)


class Lamport:
    """The all-reduce of one rank: ``fits(x)``, ``op(x)`` -> the sum over the group. ``buffers``: every rank's
    buffer address (int64, on this device), this rank's at ``rank``; the caller sets them up (``for_group``)."""

    def __init__(self, buffers: torch.Tensor, rank: int, world: int, cap: int, dtype: torch.dtype):
        self.buffers, self.rank, self.world, self.cap, self.dtype = buffers, rank, world, cap, dtype
        device = buffers.device
        self.ticket = torch.zeros(GRID, dtype=torch.int32, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.cap and x.is_contiguous()

    def __call__(self, x: torch.Tensor, phases: int = 3) -> torch.Tensor:
        if not self.fits(x):
            raise ValueError(f"the lamport all-reduce takes contiguous {self.dtype} of at most {self.cap} values")
        out = torch.empty_like(x)
        _lamport_kernel[(GRID,)](x, out, self.buffers, self.ticket, self.error, x.numel(), RANK=self.rank,
                                 WORLD=self.world, CAP=self.cap, BLOCK=BLOCK, GRID=GRID, PHASES=phases,
                                 SPIN_LIMIT=SPIN_LIMIT, PDL=PDL, **launch_options())
        return out


def buffer_words(world: int, cap: int) -> int:
    """16-bit words of one rank's buffer: three slots of a row per rank."""
    return 3 * world * cap


def for_group(group, dtype: torch.dtype, device: torch.device, cap: int) -> Lamport:
    """Every rank calls this together: its symmetric buffer, set to the sentinel, the peers' addresses."""
    import torch.distributed as dist

    from .symmetric import symmetric_buffer

    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the lamport all-reduce moves 16-bit values, not {dtype}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    buffer, ptrs = symmetric_buffer(group, buffer_words(world, cap), torch.int16, SENTINEL, device)
    op = Lamport(ptrs, rank, world, cap, dtype)
    op.buffer = buffer  # kept alive with the op
    return op
