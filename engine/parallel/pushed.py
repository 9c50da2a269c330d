"""The all-reduce after a batch-1 row-parallel projection (o, down) pushed by the projection itself (GPUs, one
row, the one-row GEMV of ``kernels.triton_gemv``; on by default, ``PDSERVE_TP_ALLREDUCE=oneshot`` is the A/B).

A row-parallel projection's output is a partial sum on every rank. Its GEMV's programs write their channels straight
into this call's slot on every rank (NVLink stores into a symmetric buffer, ``torch.distributed._symmetric_memory``)
as they finish, and a small pull kernel after it waits for every rank's row and sums: no copy into a staging buffer
and no barrier round trips, which the one-shot all-reduce pays twice a call (start and end). Measured on 2x H100,
Mistral-7B shape, batch 1: 3.74 -> 3.24 ms a step. (Summing in the next projection's norm prologue instead of a pull
kernel was tried: every program of that GEMV polls the whole row from L2 and the step took 5.24 ms.)

Slots need no clearing and no barrier: a call's slot is fixed by its place in the forward (``site``: the n-th
row-parallel projection since ``begin``), and each word carries a tag with the step's number next to the value:
``tag << 16 | bf16 bits`` in one 32-bit store, so a word either holds this step's value or an older one. The first
push of a forward advances the step counter on the device (a kernel in the stream, captured in the decode graphs);
a reader polls until every word it needs carries this step's tag (``tag = step % 32767 + 1``: never 0, the
buffer's initial value). A site is written again only in the next step that pushes, which no rank starts before
every rank has read this step's rows (it needs this rank's next push, which comes after its reads in stream order).
A one-row forward pushes the same sites in the same order on every rank, and every one-row forward the same ones
(``begin`` at each forward's start numbers them from 0), so a stale word carries the tag of the step before. A
read that never completes (a rank gone) gives up after ``SPIN_LIMIT`` polls and raises the error flag (the start-up
check reads it). The kernels: ``kernels.triton_pushed``."""
from __future__ import annotations

import os

import torch


class PushSlots:
    """One rank's slots: ``buffers`` (int64: every rank's buffer address, this rank's at ``rank``), ``sites``
    slots of a row of ``cap`` words per rank."""

    def __init__(self, buffers: torch.Tensor, rank: int, world: int, cap: int, sites: int):
        self.buffers, self.rank, self.world, self.cap, self.sites = buffers, rank, world, cap, sites
        self.step = torch.zeros(1, dtype=torch.int32, device=buffers.device)
        self.error = torch.zeros(1, dtype=torch.int32, device=buffers.device)
        self.next_site = 0

    def begin(self) -> None:
        """A forward starts: sites from 0 (its first push advances the step)."""
        self.next_site = 0

    def takes(self, rows: int, n: int, dtype: torch.dtype) -> bool:
        return rows == 1 and n <= self.cap and dtype == torch.bfloat16 and self.next_site < self.sites

    def site(self) -> int:
        """The next site of this forward; the first advances the step on the device (a kernel in the stream, so
        forwards that push nothing leave the tags alone)."""
        if self.next_site == 0:
            self.step.add_(1)
        site, self.next_site = self.next_site, self.next_site + 1
        return site

    def pull(self, site: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``[1, n]``) = the sum of every rank's push of this step into ``site``."""
        from ..kernels.triton_pushed import pull

        pull(self, site, out)
        return out


def enabled() -> bool:
    """Whether ``PDSERVE_TP_ALLREDUCE`` leaves the pushed all-reduce on (``auto``, the default)."""
    return os.environ.get("PDSERVE_TP_ALLREDUCE", "auto") == "auto"


def for_group(group, device: torch.device, cap: int, sites: int) -> PushSlots:
    """Every rank calls this together: its symmetric buffer of zeros (no step's tag), the peers' addresses."""
    import torch.distributed as dist

    from .symmetric import symmetric_buffer

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    buffer, ptrs = symmetric_buffer(group, sites * world * cap, torch.int32, 0, device)
    slots = PushSlots(ptrs, rank, world, cap, sites)
    slots.buffer = buffer  # kept alive with the slots
    return slots
