"""Decode attention straight over the paged pool, with fixed shapes (what a
CUDA graph can capture): ``store_kv`` writes each new token's K/V into its
slot (a negative slot is a padding row: it writes nothing of its own);
``rope_store`` rotates the new tokens' queries and keys and stores keys and
values the same way; ``decode`` attends each sequence's query over its
first ``lens[b]`` tokens, found through its row of ``tables`` (``[batch,
max_blocks]`` block ids); ``rope_decode`` is the two in a row. These are the torch versions (any device; the
reference in tests); ``triton_attention`` has the same functions as CUDA
kernels."""
from __future__ import annotations

import torch

from ..quant import kv_fp8


def store_kv(k_cache, v_cache, k, v, slots, scales=None) -> None:
    """``scales``: ``(k_scale, v_scale)`` of an FP8 pool (``quant.kv_fp8``: values stored divided by them)."""
    heads, dim = k_cache.shape[-2:]
    keep = slots >= 0
    index = torch.where(keep, slots, slots[0])  # padding rows repeat row 0's write (row 0 is never padding)
    ks, vs = scales or (None, None)
    for cache, new, s in ((k_cache, k, ks), (v_cache, v, vs)):
        new = kv_fp8.store(cache, torch.where(keep[:, None, None], new, new[:1]), s)
        kv_fp8.put(cache.view(-1, heads, dim), index, new)


def rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, scales=None, keep: bool = False):
    """Rotary on the new tokens' q and k (``cos``/``sin`` ``[tokens, dim]``, rounded as ``models.rope.Rotary``),
    the keys and values into their ``slots``; returns the queries ``[tokens, heads, dim]`` (``keep``: ``(q, k,
    v)``, the new keys and values as computed too)."""
    dim = k_cache.shape[-1]
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(n, heads, dim), k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim)
    cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
    half = dim // 2
    q, k = (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin for x in (q, k))
    store_kv(k_cache, v_cache, k, v, slots, scales)
    return (q, k, v.contiguous()) if keep else q


def decode(q, k_cache, v_cache, tables, lens, scale: float, window: int = 0, scales=None) -> torch.Tensor:
    """``q`` ``[batch, heads, dim]`` -> ``[batch, heads, dim]``; rows with ``lens == 0`` give zeros; ``scales``:
    an FP8 pool's ``(k_scale, v_scale)``."""
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=q.device)).flatten(1)
    ks, vs = scales or (None, None)
    keys = kv_fp8.read(k_cache.view(-1, kv_heads, dim)[slots], ks, torch.float32)
    values = kv_fp8.read(v_cache.view(-1, kv_heads, dim)[slots], vs, torch.float32)
    pos = torch.arange(slots.shape[1], device=q.device)
    lens = lens.long()[:, None]
    valid = pos[None, :] < lens
    if window:
        valid &= pos[None, :] >= lens - window
    group = heads // kv_heads
    scores = torch.einsum("bkgd,btkd->bkgt", q.float().view(batch, kv_heads, group, dim), keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)
    return out.reshape(batch, heads, dim).to(q.dtype)


def rope_decode(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, tables, lens, scale: float,
                window: int = 0, scales=None) -> torch.Tensor:
    """A decode step's attention from its qkv rows: ``rope_store``, then ``decode``."""
    q = rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, scales)
    return decode(q, k_cache, v_cache, tables, lens, scale, window, scales=scales)


def precompile(*args, **kw) -> None:
    """Nothing to compile (the Triton kernels' ``precompile`` counterpart)."""
