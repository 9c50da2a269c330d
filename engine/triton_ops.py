"""``paged``'s two operations as Triton kernels (CUDA): one launch per layer
each, no host synchronization, fixed grid for a given batch size, so a CUDA
graph captures them. ``decode`` runs one program per (sequence, KV head):
the query heads of the group share each K/V tile, read once, tiles of
``TILE`` tokens gathered through the block table, online softmax in fp32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 32


@triton.jit
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_new, stride_slot,
                  N: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        n = tl.arange(0, BLOCK_N)
        mask = n < N
        tl.store(kc_ptr + slot * stride_slot + n, tl.load(k_ptr + i * stride_new + n, mask=mask), mask=mask)
        tl.store(vc_ptr + slot * stride_slot + n, tl.load(v_ptr + i * stride_new + n, mask=mask), mask=mask)


def store_kv(k_cache, v_cache, k, v, slots) -> None:
    heads, dim = k_cache.shape[-2:]
    k, v = k.contiguous(), v.contiguous()
    n = heads * dim
    _store_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slots, k.stride(0), n, N=n,
                                 BLOCK_N=triton.next_power_of_2(n))


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, window,
                   stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ob, stride_oh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, TILE)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    for first in range((start // TILE) * TILE, ctx, TILE):
        pos = first + t
        valid = (pos < ctx) & (pos >= start)
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


def decode(q, k_cache, v_cache, tables, lens, scale: float, window: int = 0) -> torch.Tensor:
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, tables, lens, scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 1), BLOCK_SIZE=block_size, D=dim,
        BLOCK_D=triton.next_power_of_2(dim), TILE=TILE, num_warps=4)
    return out
