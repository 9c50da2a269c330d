"""``paged``'s operations as Triton kernels (CUDA): one launch per layer
each (``rope_store``: the new tokens' rotary on q and k and the K/V store;
``decode``: attention plus a merge), no host synchronization, fixed grid for a given batch size, so a CUDA
graph captures them. ``decode`` is split-K ("flash decoding"): one program
per (sequence, KV head, context split), the query heads of the group sharing
each K/V tile of ``TILE`` tokens (gathered through the block table, read
once, multiplied on tensor cores), online softmax in fp32; a second kernel
merges the splits. Small batches get more splits so every SM has work."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from .triton_layers import rotate
from .triton_pdl import ENABLED as PDL, launch_options

TILE = 64
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quantized(x, scale, FP8: tl.constexpr):
    """``x`` as the pool stores it: divided by ``scale`` and saturated for an FP8 pool (``quant.kv_fp8``)."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    return x


@triton.jit
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_new, stride_slot, k_scale, v_scale,
                  N: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        n = tl.arange(0, BLOCK_N)
        mask = n < N
        dt = kc_ptr.dtype.element_ty
        k = _quantized(tl.load(k_ptr + i * stride_new + n, mask=mask), k_scale, FP8)
        v = _quantized(tl.load(v_ptr + i * stride_new + n, mask=mask), v_scale, FP8)
        tl.store(kc_ptr + slot * stride_slot + n, k.to(dt), mask=mask)
        tl.store(vc_ptr + slot * stride_slot + n, v.to(dt), mask=mask)


def _fp8(cache, scales) -> tuple:
    """``(is the pool FP8, k_scale, v_scale)``."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    ks, vs = scales if fp8 and scales else (1.0, 1.0)
    return fp8, float(ks), float(vs)


def store_kv(k_cache, v_cache, k, v, slots, scales=None) -> None:
    heads, dim = k_cache.shape[-2:]
    k, v = k.contiguous(), v.contiguous()
    n = heads * dim
    fp8, ks, vs = _fp8(k_cache, scales)
    _store_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slots, k.stride(0), n, ks, vs, N=n,
                                 BLOCK_N=triton.next_power_of_2(n), FP8=fp8)


@triton.jit
def _keep_and_store(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, token, kvh, r1, r2, v1, v2, d, mask, stride_slot,
                    k_scale, v_scale, KV_HEADS: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr,
                    KEEP: tl.constexpr):
    """KV head(s) ``kvh`` of ``token``: the rotated key halves and the value halves to the token's pool slot (none
    for a negative slot), and with ``KEEP`` also packed, as computed, for attention over the new tokens."""
    if KEEP:
        kept = (token * KV_HEADS + kvh) * 2 * HALF
        tl.store(k_ptr + kept + d, r1, mask=mask)
        tl.store(k_ptr + kept + HALF + d, r2, mask=mask)
        tl.store(v_ptr + kept + d, v1, mask=mask)
        tl.store(v_ptr + kept + HALF + d, v2, mask=mask)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        at = slot * stride_slot + kvh * 2 * HALF
        dt = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + at + d, _quantized(r1, k_scale, FP8).to(dt), mask=mask)
        tl.store(kc_ptr + at + HALF + d, _quantized(r2, k_scale, FP8).to(dt), mask=mask)
        tl.store(vc_ptr + at + d, _quantized(v1, v_scale, FP8).to(dt), mask=mask)
        tl.store(vc_ptr + at + HALF + d, _quantized(v2, v_scale, FP8).to(dt), mask=mask)


@triton.jit
def _rope_store_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, stride_row,
                       stride_slot, k_scale, v_scale, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, KEEP: tl.constexpr,
                       PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # query heads, then KV heads (whose programs also move V)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    base = token * stride_row + head * 2 * HALF
    r1, r2 = rotate(qkv_ptr, base, cos_ptr, sin_ptr, token, d, mask, HALF, q_ptr.dtype.element_ty)
    if head < HEADS:
        out = (token * HEADS + head) * 2 * HALF
        tl.store(q_ptr + out + d, r1, mask=mask)
        tl.store(q_ptr + out + HALF + d, r2, mask=mask)
    else:
        kvh = head - HEADS
        v_at = token * stride_row + (HEADS + KV_HEADS + kvh) * 2 * HALF
        v1 = tl.load(qkv_ptr + v_at + d, mask=mask)
        v2 = tl.load(qkv_ptr + v_at + HALF + d, mask=mask)
        _keep_and_store(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, token, kvh, r1, r2, v1, v2, d, mask, stride_slot,
                        k_scale, v_scale, KV_HEADS, HALF, FP8, KEEP)


@triton.jit
def _rope_store_heads_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, stride_row,
                             stride_slot, k_scale, v_scale, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                             HALF: tl.constexpr, BLOCK: tl.constexpr, HB: tl.constexpr, FP8: tl.constexpr,
                             KEEP: tl.constexpr):
    """``_rope_store_kernel`` with ``HB`` heads a program (prompt chunks: a program per head and token made
    ~56k programs of 256 bytes each for 1,400 tokens, which ran at a tenth of the memory's speed)."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)  # blocks of query heads, then blocks of KV heads (whose programs also move V)
    q_blocks: tl.constexpr = (HEADS + HB - 1) // HB
    d = tl.arange(0, BLOCK)[None, :]
    h = tl.arange(0, HB)[:, None]
    head = block * HB + h  # a query head (in a query block)
    kvh = (block - q_blocks) * HB + h  # a KV head (in a KV block)
    is_q = block < q_blocks
    mask = (d < HALF) & tl.where(is_q, head < HEADS, (kvh >= 0) & (kvh < KV_HEADS))
    base = token * stride_row + tl.where(is_q, head, HEADS + kvh) * 2 * HALF
    r1, r2 = rotate(qkv_ptr, base, cos_ptr, sin_ptr, token, d, mask, HALF, q_ptr.dtype.element_ty)
    if is_q:
        out = (token * HEADS + head) * 2 * HALF
        tl.store(q_ptr + out + d, r1, mask=mask)
        tl.store(q_ptr + out + HALF + d, r2, mask=mask)
    else:
        v_at = token * stride_row + (HEADS + KV_HEADS + kvh) * 2 * HALF
        v1 = tl.load(qkv_ptr + v_at + d, mask=mask)
        v2 = tl.load(qkv_ptr + v_at + HALF + d, mask=mask)
        _keep_and_store(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, token, kvh, r1, r2, v1, v2, d, mask, stride_slot,
                        k_scale, v_scale, KV_HEADS, HALF, FP8, KEEP)


HEADS_A_PROGRAM = 8
HEADS_FROM_TOKENS = 128  # below (decode steps): a program per head, the most programs for few tokens


def rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, scales=None, keep: bool = False,
               heads_a_program: int | None = None):
    """``qkv`` ``[tokens, (heads + 2 kv_heads) * dim]`` -> the rotated queries ``[tokens, heads, dim]``; the
    rotated keys and the values go straight to their ``slots`` of the pool (none for a negative slot).
    ``keep``: ``(q, k, v)``, the new keys and values also returned packed ``[tokens, kv_heads, dim]`` as
    computed (before an FP8 pool's scaling), for attention over the new tokens (a prompt chunk).
    ``heads_a_program``: 1 for a program per (token, head); default ``HEADS_A_PROGRAM`` from
    ``HEADS_FROM_TOKENS`` tokens on, else 1."""
    dim = k_cache.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty(qkv.shape[0], heads, dim, dtype=qkv.dtype, device=qkv.device)
    k, v = (torch.empty(qkv.shape[0], kv_heads, dim, dtype=qkv.dtype, device=qkv.device) for _ in range(2)) \
        if keep else (q, q)
    half = dim // 2
    fp8, ks, vs = _fp8(k_cache, scales)
    hb = triton.next_power_of_2(heads_a_program or (HEADS_A_PROGRAM if qkv.shape[0] >= HEADS_FROM_TOKENS else 1))
    args = (qkv, q, k_cache, v_cache, k, v, cos, sin, slots, qkv.stride(0), kv_heads * dim, ks, vs)
    shape = dict(HEADS=heads, KV_HEADS=kv_heads, HALF=half, BLOCK=triton.next_power_of_2(half), FP8=fp8, KEEP=keep)
    if hb > 1:
        blocks = triton.cdiv(heads, hb) + triton.cdiv(kv_heads, hb)
        _rope_store_heads_kernel[(qkv.shape[0], blocks)](*args, **shape, HB=hb)
    else:
        _rope_store_kernel[(qkv.shape[0], heads + kv_heads)](*args, **shape, PDL=PDL, **launch_options())
    return (q, k, v) if keep else q


@triton.jit
def attend_tile(q, k_ptr, v_ptr, rows, d, valid, kv_mask, m, l_sum, acc, scale, PRECISION: tl.constexpr):
    """One tile of the online softmax: keys and values at the pool ``rows`` (``valid`` tokens) read as ``q``'s
    dtype (an FP8 pool widens), scores, the running max ``m``, sum ``l_sum`` and output ``acc`` updated."""
    k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc


@triton.jit(do_not_specialize=["scale", "v_scale", "window", "stride_qb", "stride_qh", "stride_tb"])  # one variant for any
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_o, part_ml, scale, v_scale, window,
                   stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb,
                   SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # q and the new token's K/V come from rope_store
        tl.extra.cuda.gdc_wait()
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
    elif HALF:  # an FP8 pool: e4m3 widens to fp16 in one instruction (bf16 takes several), exact either way
        q = q.to(tl.float16)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(lo, hi, TILE):
        pos = first + t
        valid = pos < hi
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        m, l_sum, acc = attend_tile(q, k_ptr, v_ptr, rows, d, valid, valid[:, None] & dmask[None, :], m, l_sum, acc,
                                    scale, PRECISION)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    at = (b * tl.num_programs(1) * GROUP + heads) * SPLITS + split
    tl.store(part_o + at[:, None] * BLOCK_D + d[None, :], acc * v_scale, mask=gmask[:, None])
    tl.store(part_ml + at * 2, m, mask=gmask)
    tl.store(part_ml + at * 2 + 1, l_sum, mask=gmask)


@triton.jit
def _combine_kernel(part_o, part_ml, out_ptr, stride_ob, stride_oh,
                    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


@dataclass(frozen=True)
class DecodeConfig:
    """How ``decode`` runs: ``tile`` tokens per K/V load, ``warps`` and software-pipeline ``stages`` per program,
    and the context splits per (sequence, KV head): enough for ``per_sm`` programs per SM, at most ``max_splits``.
    ``pdserve bench kernels --sweep`` times the alternatives; ``config_for`` picks by batch (measured on H200:
    98% of the copy bandwidth at 16 x 8k and 64 x 2k, 1 x 8k in 1.5x its bytes / bandwidth)."""
    tile: int = TILE
    warps: int = 4
    stages: int = 4
    per_sm: int = 4
    max_splits: int = 32

    def as_dict(self) -> dict:
        return asdict(self)


CPU_SMS = 8  # what splits_for counts on the CPU (the interpreter): enough splits to test the combine at small batch
CONFIG = DecodeConfig(per_sm=4)
SMALL = DecodeConfig(tile=128, stages=3)  # a few sequences: longer tiles per split (H200 sweep, 1 x 4k-8k context)
FP8 = DecodeConfig(tile=128, stages=2)  # an FP8 pool at any batch: within 2% of the best (H200 sweep; 64 x 4: 1.4x)


def config_for(batch: int, kv_heads: int, fp8: bool = False) -> DecodeConfig:
    if fp8:
        return FP8
    return SMALL if batch * kv_heads <= 32 else CONFIG


def splits_for(batch: int, kv_heads: int, device, config: DecodeConfig = CONFIG) -> int:
    """A power of two (a compile-time constant of the kernels: few variants, all compiled by ``precompile``)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_SMS
    want = max(1, min(config.max_splits, (config.per_sm * sms) // max(1, batch * kv_heads)))
    return 1 << (want.bit_length() - 1)


def precompile(q, k_cache, v_cache, scale: float, window: int, max_batch: int) -> None:
    """Compile every variant ``decode`` can pick for up to ``max_batch`` sequences (a mixed step may have any
    number of decode rows), so none compiles while serving. The interpreter compiles nothing: nothing to do."""
    if INTERPRETED:
        return
    kv_heads, fp8 = k_cache.shape[2], k_cache.dtype == torch.float8_e4m3fn
    tables = torch.zeros(max_batch, 2, dtype=torch.long, device=q.device)
    packed = torch.zeros(max_batch, 3, dtype=torch.long, device=q.device)  # the runner's tables: lengths last
    packed[:, 2] = 1
    seen = set()
    for batch in range(1, max_batch + 1):
        config = config_for(batch, kv_heads, fp8)
        key = (config, splits_for(batch, kv_heads, q.device, config))
        if key in seen:
            continue
        seen.add(key)
        lens = torch.ones(batch, dtype=torch.int32, device=q.device)
        decode(q[:1].expand(batch, -1, -1), k_cache, v_cache, tables[:batch], lens, scale, window)
        decode(q[:1].expand(batch, -1, -1), k_cache, v_cache, packed[:batch, :2], packed[:batch, 2], scale, window)


def decode(q, k_cache, v_cache, tables, lens, scale: float, window: int = 0,
           config: DecodeConfig | None = None, scales=None) -> torch.Tensor:
    """Attention of each row's query over its first ``lens`` tokens of the pool; an FP8 pool's values are read as
    the query's dtype, the K scale folded into the softmax scale and the V scale into the output."""
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    config = config or config_for(batch, kv_heads, k_cache.dtype == torch.float8_e4m3fn)
    group = heads // kv_heads
    splits = splits_for(batch, kv_heads, q.device, config)
    upcast = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)  # the interpreter has no bf16 dot
    fp8, ks, vs = _fp8(k_cache, scales)
    block_d = max(triton.next_power_of_2(dim), 16)
    # lens may be a column of the runner's packed tables: a fresh int32 copy (a 16-byte aligned pointer, or a row
    # of one would compile another variant), none for the graphs' own int32 buffer
    q, lens = q.contiguous(), lens.to(torch.int32).contiguous()
    part_o = torch.empty(batch * heads * splits * block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * heads * splits * 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, part_o, part_ml, scale * ks, vs, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        SPLITS=splits, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_SIZE=block_size, D=dim,
        BLOCK_D=block_d, TILE=config.tile, PRECISION="ieee" if upcast else "tf32", UPCAST=upcast, HALF=fp8,
        PDL=PDL, num_warps=config.warps, num_stages=config.stages, **launch_options())
    out = torch.empty_like(q)
    _combine_kernel[(batch, heads)](part_o, part_ml, out, out.stride(0), out.stride(1), SPLITS=splits,
                                    BLOCK_S=max(triton.next_power_of_2(splits), 2), D=dim, BLOCK_D=block_d, PDL=PDL,
                                    **launch_options())
    return out


def rope_decode(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, tables, lens, scale: float,
                window: int = 0, scales=None) -> torch.Tensor:
    """``rope_store`` then ``decode`` (one fused launch measured no faster on an H100: bench/RESULTS.md)."""
    q = rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, scales)
    return decode(q, k_cache, v_cache, tables, lens, scale, window, scales=scales)
