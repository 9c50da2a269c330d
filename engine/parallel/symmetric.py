"""A symmetric buffer for a TP group's barrier-free collective (``pushed``): every rank allocates the
same size through ``torch.distributed._symmetric_memory``, and each can store into every peer's over NVLink."""
from __future__ import annotations

import torch


def symmetric_buffer(group, words: int, dtype: torch.dtype, fill: int, device: torch.device):
    """Every rank calls this together: ``(this rank's buffer of words set to fill, every rank's address as int64 on
    the device, this rank's at its rank)``; no rank returns before every buffer holds ``fill``."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(words, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    buffer.fill_(fill)
    torch.cuda.synchronize(device)
    dist.barrier(group)  # nobody writes into a peer before every buffer holds the fill value
    return buffer, torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
