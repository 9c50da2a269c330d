"""The collective operations of a tensor-parallel group (nothing at all for a group of one)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    size: int = 1
    rank: int = 0
    group: object = None  # the torch.distributed process group
    plan: object = None  # rank 0: the PlanSender; followers: None
    one_shot: object = None  # ``allreduce.OneShot`` for small tensors on GPUs
    pushed: object = None  # ``pushed.PushSlots``: batch-1 row-parallel GEMVs push their sums into slots

    def begin_forward(self) -> None:
        """A forward starts (its pushed rows get this step's tag)."""
        if self.pushed is not None:
            self.pushed.begin()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (a new tensor, or ``x`` reduced in place)."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank joined along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def share_tokens(self, tokens: torch.Tensor | None, rows: int, device) -> torch.Tensor:
        """Rank 0's ``tokens`` (``rows`` longs, on the device) on every rank, without waiting on the host: rank 0
        passes them, the others None."""
        if tokens is None:
            tokens = torch.empty(rows, dtype=torch.long, device=device)
        dist.broadcast(tokens, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tokens

    def min_int(self, value: int, device) -> int:
        """The smallest of every rank's ``value``."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TPGroup()


def join(size: int, rank: int, init_method: str, device: torch.device, timeout_s: float = 120.0,
         store=None) -> TPGroup:
    """Join the group (``init_method``: ``tcp://HOST:PORT`` of rank 0's store; rank 0 passes that store, which it
    already listens on, as ``store``): NCCL on CUDA, gloo elsewhere."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if backend == "nccl" else {}
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, world_size=size, rank=rank, timeout=timeout, **kw)
    return TPGroup(size, rank, dist.group.WORLD)
