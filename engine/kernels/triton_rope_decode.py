"""A decode step's attention in one launch: rotary, the K/V store, split-K attention and the merge of the splits
(``rope_decode``; ``PDSERVE_ROPE_DECODE=1``, off: on an H100 it measured no faster than the three launches).

``triton_attention`` runs a decode layer's attention as three launches: ``rope_store`` (rotary on q and k, K/V
into the pool), the split-K kernel, the merge. At batch 1 each is a few microseconds of work whose cost is the
chain itself (wait for the kernel before, a load, a store, the next waits): ~2-3 us a launch, 32 layers, against a
step of 3.9 ms that the batch-1 bar wants at 3.77. Here one program per (sequence, KV head, context split):

* takes its group's query heads straight from the qkv projection's row and rotates them as it loads them (every
  split of a head does, the few multiplies are free), so no rotated q is written and read back;
* takes the new token's key (rotated) and value from the same row: the program of split 0 stores them into the
  pool (FP8-scaled where the pool is FP8), and the split whose range holds the new position adds it to its
  softmax from registers instead of from the pool (no program waits for the store);
* writes its partial sums as the split-K kernel does, then counts itself done on a per-(sequence, KV head)
  counter (an atomic after a barrier: its partials are written first); the last of the splits to finish merges
  them into the output and sets the counter back to 0 for the next layer.

Same rounding as the three launches (q, k rotated as ``Rotary`` rounds; the new key and value as the pool holds
them); only the order of the softmax sums differs. Rows of a decode graph only: one new token per row, at position
``lens[b] - 1`` with its ``slot`` (a padding row: slot -1, length 0)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_attention import _fp8, _quantized, attend_tile, config_for, splits_for
from .triton_pdl import ENABLED as PDL, launch_options

ENABLED = os.environ.get("PDSERVE_ROPE_DECODE", "0") == "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_counters: dict = {}  # (device, size) -> zeroed int32 counters, one per (row, KV head); each kernel leaves them 0


@triton.jit
def _rotated(row_ptr, col, cos_ptr, sin_ptr, b, d, mask, HALF: tl.constexpr, dt: tl.constexpr):
    """Columns ``col + d`` of a head in the qkv row, rotated and rounded as ``rotate`` does (``d`` spans the whole
    head: the first half pairs with the second)."""
    D: tl.constexpr = 2 * HALF
    own = tl.load(row_ptr + col + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(row_ptr + col + (d + HALF) % D, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + b * D + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + b * D + d, mask=mask, other=0.0).to(dt).to(tl.float32)
    sign = tl.where(d < HALF, -1.0, 1.0)
    return ((own * c).to(dt).to(tl.float32) + (sign * partner * s).to(dt).to(tl.float32)).to(dt)


@triton.jit(do_not_specialize=["scale", "k_scale", "v_scale", "window", "stride_row", "stride_tb"])
def _rope_decode_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_o, part_ml,
                        count_ptr, out_ptr, scale, k_scale, v_scale, window, stride_row, stride_cb, stride_ct,
                        stride_tb, stride_ob, stride_oh,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
                        TILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
                        PDL: tl.constexpr):
    D: tl.constexpr = 2 * HALF
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the qkv row comes from the projection before
        tl.extra.cuda.gdc_wait()
    dt = qkv_ptr.dtype.element_ty
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    row = qkv_ptr + b.to(tl.int64) * stride_row
    q = _rotated(row, heads[:, None] * D, cos_ptr, sin_ptr, b, d[None, :], gmask[:, None], HALF, dt)
    k_new = _rotated(row, (HEADS + kvh) * D, cos_ptr, sin_ptr, b, d, d < D, HALF, dt)
    v_new = tl.load(row + (HEADS + KV_HEADS + kvh) * D + d)
    ctx = tl.load(lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kc = k_ptr.dtype.element_ty
    k_new = _quantized(k_new, k_scale, FP8).to(kc)  # as the pool holds them: what the other tokens are read as
    v_new = _quantized(v_new, v_scale, FP8).to(kc)
    if (split == 0) & (slot >= 0):
        tl.store(k_ptr + slot * stride_ct + kvh * D + d, k_new)
        tl.store(v_ptr + slot * stride_ct + kvh * D + d, v_new)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # e4m3 widens to fp16 in one instruction, exact either way
        q = q.to(tl.float16)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per = tl.cdiv(tl.cdiv(ctx - start, SPLITS), TILE) * TILE
    lo = start + split * per
    hi = tl.minimum(lo + per, ctx)
    last = ctx - 1  # the new token's position: from registers, not the pool
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for first in range(lo, tl.minimum(hi, last), TILE):
        pos = first + t
        valid = pos < tl.minimum(hi, last)
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * D
        m, l_sum, acc = attend_tile(q, k_ptr, v_ptr, rows, d, valid, valid[:, None], m, l_sum, acc, scale, PRECISION)
    if (last >= lo) & (last < hi):
        s_new = tl.sum(q.to(tl.float32) * k_new.to(q.dtype).to(tl.float32)[None, :], axis=1) * scale
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s_new - m_new)
        l_sum = l_sum * alpha + p
        v_row = v_new.to(q.dtype)
        acc = acc * alpha[:, None] + p.to(v_row.dtype).to(tl.float32)[:, None] * v_row.to(tl.float32)[None, :]
        m = m_new
    at = (b * KV_HEADS * GROUP + heads) * SPLITS + split
    tl.store(part_o + at[:, None] * D + d[None, :], acc * v_scale, mask=gmask[:, None])
    tl.store(part_ml + at * 2, m, mask=gmask)
    tl.store(part_ml + at * 2 + 1, l_sum, mask=gmask)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.debug_barrier()  # every thread's partials written before the count says so
    counter = count_ptr + b * KV_HEADS + kvh
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # the last split of this (row, KV head)
        _merge(part_o, part_ml, out_ptr, b, kvh, stride_ob, stride_oh, KV_HEADS, GROUP, SPLITS, BLOCK_S, D)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _merge(part_o, part_ml, out_ptr, b, kvh, stride_ob, stride_oh, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
           SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """``_combine_kernel``'s sums for the group's query heads, read past the caches (other SMs wrote them)."""
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    smask = sp < SPLITS
    for g in tl.static_range(GROUP):
        head = kvh * GROUP + g
        at = (b * KV_HEADS * GROUP + head) * SPLITS + sp
        m = tl.load(part_ml + at * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
        l_sum = tl.load(part_ml + at * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
        top = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        total = tl.sum(w * l_sum, axis=0)
        o = tl.load(part_o + at[:, None] * D + d[None, :], mask=smask[:, None], other=0.0, cache_modifier=".cg")
        out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def takes(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``rope_decode`` runs the fused kernel: enabled, a power-of-two head size (a whole head per load)."""
    dim = k_cache.shape[-1]
    return ENABLED and dim >= 16 and dim & (dim - 1) == 0 and (qkv.is_cuda or INTERPRETED)


def _counts(device, n: int) -> torch.Tensor:
    key = (str(device), n)
    if key not in _counters:
        _counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _counters[key]


def rope_decode(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, tables, lens, scale: float,
                window: int = 0, scales=None) -> torch.Tensor:
    """Attention output ``[rows, heads, dim]`` of decode rows whose q, k, v are in ``qkv`` (one new token each, at
    position ``lens - 1``, stored into ``slots``): ``triton_attention.rope_store`` then ``decode``, in one launch."""
    batch, dim = qkv.shape[0], k_cache.shape[-1]
    block_size = k_cache.shape[1]
    fp8, ks, vs = _fp8(k_cache, scales)
    config = config_for(batch, kv_heads, fp8)
    splits = splits_for(batch, kv_heads, qkv.device, config)
    group = heads // kv_heads
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    lens = lens.to(torch.int32).contiguous()
    upcast = qkv.dtype == torch.float32 or (INTERPRETED and qkv.dtype == torch.bfloat16)
    part_o = torch.empty(batch * heads * splits * dim, dtype=torch.float32, device=qkv.device)
    part_ml = torch.empty(batch * heads * splits * 2, dtype=torch.float32, device=qkv.device)
    out = torch.empty(batch, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_decode_kernel[(batch, kv_heads, splits)](
        qkv, cos, sin, slots, k_cache, v_cache, tables, lens, part_o, part_ml, _counts(qkv.device, batch * kv_heads),
        out, scale * ks, ks, vs, window, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), HEADS=heads, KV_HEADS=kv_heads, SPLITS=splits, GROUP=group,
        BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_S=max(triton.next_power_of_2(splits), 2),
        BLOCK_SIZE=block_size, HALF=dim // 2, TILE=config.tile, PRECISION="ieee" if upcast else "tf32",
        UPCAST=upcast, FP8=fp8, PDL=PDL, num_warps=config.warps, num_stages=config.stages, **launch_options())
    return out
