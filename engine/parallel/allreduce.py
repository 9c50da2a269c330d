"""The all-reduce of a tensor-parallel group on GPUs: NCCL, or a one-shot all-reduce over symmetric memory.

A decode step all-reduces small tensors (``[batch, hidden]``: 16 KiB at batch 1 of an 8192-wide model) twice per
layer, where NCCL's fixed cost dominates. ``torch.ops.symm_mem.one_shot_all_reduce`` has every rank read its
peers' copies straight over NVLink (CUDA IPC, one kernel, NVLink multicast not used). Measured on 2x H200 inside
CUDA graphs (``python -m bench.lab.allreduce``): 6.4 vs 28.3 us at 16 KiB, 19 vs 46 us at 2 MiB, 97 vs 118 us at
16 MiB. So tensors up to ``MAX_BYTES`` go one-shot (through a symmetric buffer made at start-up; every rank makes
it at the same point of the engine's construction), larger ones (prefill) through NCCL.
``PDSERVE_TP_ALLREDUCE=nccl`` turns it off; so does a first call that disagrees with NCCL.
``auto`` also has batch 1's row-parallel all-reduces pushed by the projections (``pushed``; ``pushed_slots`` makes
the slots); ``oneshot`` is ``auto`` without that (the A/B)."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
MAX_BYTES = 4 << 20
CHOICES = ("auto", "oneshot", "nccl")


class OneShot:
    def __init__(self, group, dtype: torch.dtype, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.name = group.group_name
        self.numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        self.copying = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
        self.dtype = dtype

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[:x.numel()].view(x.shape)
        if self.copying:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.name)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.name)


def one_shot(group, dtype: torch.dtype, device: torch.device) -> OneShot | None:
    """The one-shot all-reduce for this group (every rank calls this together), or None: not CUDA, turned off, not
    available in this torch, or a check against NCCL that failed."""
    choice = os.environ.get("PDSERVE_TP_ALLREDUCE", "auto")
    if choice not in CHOICES:
        raise ValueError(f"PDSERVE_TP_ALLREDUCE={choice}: use one of {', '.join(CHOICES)}")
    if device.type != "cuda" or choice == "nccl":
        return None
    try:
        op = OneShot(group, dtype, device)
        probe = torch.arange(3 * 1000, device=device, dtype=torch.float32).to(dtype).view(3, 1000) / 1000
        probe = probe + dist.get_rank(group)
        want = probe.clone()
        dist.all_reduce(want, group=group)
        agree = _matches(op(probe), want, None)
    except Exception as e:  # noqa: BLE001 - an older torch, no peer access: NCCL it is
        log.warning("one-shot all-reduce unavailable (%s): NCCL for every all-reduce", e)
        return None
    if not _everywhere(agree, group, device):
        log.warning("one-shot all-reduce disagreed with NCCL: NCCL for every all-reduce")
        return None
    log.info("one-shot all-reduce over symmetric memory for tensors up to %d KiB", op.numel * dtype.itemsize >> 10)
    return op


def pushed_slots(group, hidden: int, layers: int, device: torch.device):
    """The slots batch-1 row-parallel projections push into (``pushed``; every rank calls this together), or None:
    not asked for, not CUDA, or a check against NCCL that failed."""
    from . import pushed

    if not pushed.enabled() or device.type != "cuda":
        return None
    try:
        from ..kernels.triton_pushed import push_row

        slots = pushed.for_group(group, device, cap=hidden, sites=2 * layers + 2)
        probe = (torch.arange(hidden, device=device, dtype=torch.float32) / hidden + dist.get_rank(group))[None]
        want = probe.to(torch.bfloat16).float()
        dist.all_reduce(want, group=group)
        slots.begin()
        site = slots.site()
        push_row(slots, site, probe)
        agree = _matches(slots.pull(site, torch.empty(1, hidden, dtype=torch.bfloat16, device=device)), want,
                         slots.error)
    except Exception as e:  # noqa: BLE001 - no symmetric memory or Triton here
        log.warning("pushed all-reduce unavailable (%s)", e)
        agree = False
    if not _everywhere(agree, group, device):
        log.warning("pushed all-reduce disagreed with NCCL or failed: off")
        return None
    log.info("batch-1 row-parallel all-reduces pushed by the projections (%d sites)", slots.sites)
    return slots


def _matches(got: torch.Tensor, want: torch.Tensor, error: torch.Tensor | None) -> bool:
    """A start-up check's sums equal NCCL's (within bf16 rounding) and no read gave up."""
    return torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2) and (error is None or not error.item())


def _everywhere(agree: bool, group, device: torch.device) -> bool:
    """Whether every rank's check agreed (a collective: every rank calls it)."""
    ok = torch.tensor([int(agree)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())
