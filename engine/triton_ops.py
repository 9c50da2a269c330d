"""``paged``'s two operations as Triton kernels (CUDA): one launch per layer
each, no host synchronization, fixed grid for a given batch size, so a CUDA
graph captures them. ``decode`` is split-K ("flash decoding"): one program
per (sequence, KV head, context split), the query heads of the group sharing
each K/V tile of ``TILE`` tokens (gathered through the block table, read
once, multiplied on tensor cores), online softmax in fp32; a second kernel
merges the splits. Small batches get more splits so every SM has work."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE = 64
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_o, part_ml, scale, window,
                   stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb,
                   SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per = tl.cdiv(tl.cdiv(ctx - start, SPLITS), TILE) * TILE
    lo = start + split * per
    hi = tl.minimum(lo + per, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, TILE)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(lo, hi, TILE):
        pos = first + t
        valid = pos < hi
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    at = (b * tl.num_programs(1) * GROUP + heads) * SPLITS + split
    tl.store(part_o + at[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])
    tl.store(part_ml + at * 2, m, mask=gmask)
    tl.store(part_ml + at * 2 + 1, l_sum, mask=gmask)


@triton.jit
def _combine_kernel(part_o, part_ml, out_ptr, stride_ob, stride_oh,
                    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    at = (b * tl.num_programs(1) + h) * SPLITS + sp
    smask = sp < SPLITS
    m = tl.load(part_ml + at * 2, mask=smask, other=float("-inf"))
    l_sum = tl.load(part_ml + at * 2 + 1, mask=smask, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    total = tl.sum(w * l_sum, axis=0)
    o = tl.load(part_o + at[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def splits_for(batch: int, kv_heads: int, device) -> int:
    """Context splits per (sequence, KV head): enough programs for about two per SM, at most 32."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(32, (2 * sms) // max(1, batch * kv_heads)))


def decode(q, k_cache, v_cache, tables, lens, scale: float, window: int = 0) -> torch.Tensor:
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = splits_for(batch, kv_heads, q.device)
    upcast = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)  # the interpreter has no bf16 dot
    block_d = max(triton.next_power_of_2(dim), 16)
    q = q.contiguous()
    part_o = torch.empty(batch * heads * splits * block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * heads * splits * 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, part_o, part_ml, scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        SPLITS=splits, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_SIZE=block_size, D=dim,
        BLOCK_D=block_d, TILE=TILE, PRECISION="ieee" if upcast else "tf32", UPCAST=upcast, num_warps=4)
    out = torch.empty_like(q)
    _combine_kernel[(batch, heads)](part_o, part_ml, out, out.stride(0), out.stride(1), SPLITS=splits,
                                    BLOCK_S=max(triton.next_power_of_2(splits), 2), D=dim, BLOCK_D=block_d)
    return out
