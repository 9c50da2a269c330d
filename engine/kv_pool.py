"""The paged KV pool: per layer one K and one V tensor ``[num_blocks,
block_size, kv_heads, head_dim]``, allocated once at start-up from the KV
budget. ``gather``/``scatter`` move one sequence's KV between its blocks and
the canonical per-layer ``[kv_heads, tokens, head_dim]`` tensors the
transports carry."""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]
        self.block_size = block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim

    @staticmethod
    def bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    def _slots(self, table: list[int], tokens: int, device) -> torch.Tensor:
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=device)).flatten()[:tokens]

    def gather(self, table: list[int], tokens: int, into: list | None = None) -> list:
        """The sequence's KV as canonical ``(k, v)`` per layer (written into ``into`` when given)."""
        out = []
        slots = self._slots(table, tokens, self.layers[0][0].device)
        for i, (kc, vc) in enumerate(self.layers):
            k = kc.view(-1, self.kv_heads, self.head_dim)[slots].transpose(0, 1)
            v = vc.view(-1, self.kv_heads, self.head_dim)[slots].transpose(0, 1)
            if into is not None:
                into[i][0].copy_(k)
                into[i][1].copy_(v)
                out.append(into[i])
            else:
                out.append((k.contiguous(), v.contiguous()))
        return out

    def scatter(self, table: list[int], layers) -> None:
        """Write canonical ``(k, v)`` layers (any device/dtype-compatible tensors) into the sequence's blocks."""
        it = iter(layers)
        first = next(it)
        tokens = first[0].shape[1]
        slots = self._slots(table, tokens, self.layers[0][0].device)
        for (kc, vc), (k, v) in zip(self.layers, [first, *it], strict=True):
            kc.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k.transpose(0, 1).to(kc.device, kc.dtype))
            vc.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v.transpose(0, 1).to(vc.device, vc.dtype))
