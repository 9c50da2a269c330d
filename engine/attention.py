"""Attention over the paged KV pool.

The pool holds, per layer, ``k_cache``/``v_cache`` shaped ``[num_blocks,
block_size, kv_heads, head_dim]``. A batch is the new tokens of several
sequences packed one after another; ``AttnMeta`` says where each sequence's
tokens start, how long its context is once they are written, which blocks
hold it, and the flat slot (``block * block_size + offset``) of every new
token. Each layer first writes the new K/V into their slots, then attends:
decode-only batches in one padded, masked SDPA call over the gathered
blocks; batches with prompt chunks sequence by sequence (causal, offset by
the cached prefix). This is the portable backend (CPU, and correct on CUDA);
faster kernels plug in behind ``attend``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor
    query_starts: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    block_size: int
    decode_only: bool
    sliding_window: int | None = None

    def context_slots(self, i: int) -> torch.Tensor:
        table = self.block_tables[i, : -(-self.context_lens[i] // self.block_size)]
        offsets = torch.arange(self.block_size, device=table.device)
        return (table[:, None] * self.block_size + offsets).flatten()[: self.context_lens[i]]


def write_kv(k_cache, v_cache, k, v, slots) -> None:
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slots, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slots, v)


def _window(mask, q_pos, k_pos, window):
    return mask & (k_pos[None, :] > q_pos[:, None] - window) if window else mask


def attend(q, k, v, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    """``q`` ``[tokens, heads, dim]``, ``k``/``v`` ``[tokens, kv_heads, dim]`` -> ``[tokens, heads, dim]``."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.decode_only:
        return _decode(q, k_cache, v_cache, meta, scale)
    heads, dim = k_cache.shape[-2:]
    flat_k, flat_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    out = torch.empty_like(q)
    for i, ctx in enumerate(meta.context_lens):
        s, e = meta.query_starts[i], meta.query_starts[i + 1]
        n = e - s
        if n == ctx and not meta.sliding_window:
            keys, values, mask, causal = k[s:e], v[s:e], None, True
        else:
            slots = meta.context_slots(i)
            keys, values, causal = flat_k[slots], flat_v[slots], False
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            k_pos = torch.arange(ctx, device=q.device)
            mask = _window(k_pos[None, :] <= q_pos[:, None], q_pos, k_pos, meta.sliding_window)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    heads, dim = k_cache.shape[-2:]
    longest = max(meta.context_lens)
    blocks = -(-longest // meta.block_size)
    table = meta.block_tables[:, :blocks]
    slots = (table[:, :, None] * meta.block_size + torch.arange(meta.block_size, device=q.device)).flatten(1)[:, :longest]
    keys = k_cache.view(-1, heads, dim)[slots].transpose(1, 2)
    values = v_cache.view(-1, heads, dim)[slots].transpose(1, 2)
    lens = torch.tensor(meta.context_lens, device=q.device)
    k_pos = torch.arange(longest, device=q.device)
    mask = k_pos[None, :] < lens[:, None]
    if meta.sliding_window:
        mask &= k_pos[None, :] > (lens[:, None] - 1 - meta.sliding_window)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)
