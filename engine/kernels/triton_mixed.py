"""Attention for any mix of decode rows and prompt chunks in one launch, straight over the paged pool, with a grid
fixed by the step's token count (what a CUDA graph of a mixed step captures: ``cuda_graphs.mixed``).

The step's queries ``[tokens, heads, dim]`` are cut into tiles of at most ``BLOCK_Q`` consecutive tokens of one
sequence; a decode row is a tile of one token. ``tiles`` (int32 ``[max tiles, 8]``, on the device) holds per tile
its sequence (a row of ``tables``; -1: no tile, the program returns), its first query row, its token count, the
position of its first token, the key range ``[first, end)`` it reads and the scratch slot it writes (-1: the rows of
``out`` themselves). One program per (tile, KV head) attends the tile's tokens times the group's query
heads (``BLOCK_Q * GROUP`` rows on tensor cores) over the sequence's keys ``[0, last position]`` in tiles of
``TILE`` keys read through the block table, causal (and within a sliding window), online softmax in fp32. An FP8
pool widens as the decode kernel's does (its K scale folded into the softmax scale, its V scale into the output).
Rows of ``out`` that no tile names are left as they were.

Long key ranges are split (flash-decoding): a tile whose sequence has more than ``SPLIT_KEYS`` keys to read is cut
by ``cut`` into up to ``MAX_SPLITS`` entries over consecutive key ranges, each of which writes its normalised
partial output and its rows' softmax max and sum to a slot of a scratch buffer (``PARTS`` slots a step); a second
launch (``_merge_kernel``, one program per (split tile, KV head), ``merges`` ``[most_merges(), 4]``: first query
row, tokens, first slot, slots; -1: none) weighs the slots by their sums and writes the rows. Without it a chunk
deep into a long prompt left a few programs each walking thousands of keys (a 64-token chunk after 4k tokens of its
prompt: 4 tiles x 8 KV heads on a GPU of 132 SMs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import INTERPRETED, _fp8

TILE = 64
ROWS = 64  # query rows of a program: BLOCK_Q tokens times the GQA group (padded to a power of two)
SPLIT_KEYS = 512  # a tile reading more keys than this is split (each part about this many keys)
MAX_SPLITS = 8
PARTS = 64  # scratch slots of a step: split parts in all
NO_TILE = (-1, 0, 0, 0, 0, 0, -1, 0)
NO_MERGE = (-1, 0, 0, 0)


def block_q(heads: int, kv_heads: int) -> int:
    """Tokens per tile for this head layout."""
    return max(1, ROWS // triton.next_power_of_2(heads // kv_heads))


def most_tiles(tokens: int, seqs: int, per_tile: int) -> int:
    """The most tile entries ``tokens`` tokens of at most ``seqs`` sequences cut into, splits included."""
    return -(-tokens // per_tile) + min(tokens, seqs) + PARTS


def most_merges() -> int:
    return PARTS // 2


def cut(query_starts: list[int], starts: list[int], per_tile: int, window: int = 0) -> tuple[list, list]:
    """``(tiles, merges)`` of sequences packed at ``query_starts`` whose first new token is at position
    ``starts[i]``: tiles ``(sequence, first query row, tokens, first position, first key, key end, slot, 0)``, the
    longest key ranges split while slots last, and the merges ``(first query row, tokens, first slot, slots)``."""
    plain = []
    for i, pos in enumerate(starts):
        row, end = query_starts[i], query_starts[i + 1]
        for first in range(row, end, per_tile):
            n, p0 = min(per_tile, end - first), pos + first - row
            lo = max(p0 - window + 1, 0) // TILE * TILE if window > 0 else 0
            plain.append((i, first, n, p0, lo, p0 + n))
    long = sorted((t for t in plain if t[5] - t[4] > SPLIT_KEYS), key=lambda t: t[4] - t[5])
    share = max(2, PARTS // len(long)) if long else 0
    splits, left = {}, PARTS
    for t in long:
        k = min(MAX_SPLITS, share, left, -(-(t[5] - t[4]) // SPLIT_KEYS), -(-(t[5] - t[4]) // TILE))
        if k >= 2:
            splits[t[:2]] = k
            left -= k
    tiles, merges, slot = [], [], 0
    for seq, first, n, p0, lo, hi in plain:
        k = splits.get((seq, first), 1)
        if k == 1:
            tiles.append((seq, first, n, p0, lo, hi, -1, 0))
            continue
        span = -(-(hi - lo) // (k * TILE)) * TILE
        bounds = list(range(lo, hi, span))
        for j, b in enumerate(bounds):
            tiles.append((seq, first, n, p0, b, min(b + span, hi), slot + j, 0))
        merges.append((first, n, slot, len(bounds)))
        slot += len(bounds)
    return tiles, merges


@triton.jit(do_not_specialize=["scale", "v_scale", "window", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                               "stride_tb"])
def _mixed_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tiles_ptr, parts_ptr, ml_ptr, scale, v_scale, window,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_tb,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, HALF: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 8)
    if seq < 0:
        return
    row0 = tl.load(tiles_ptr + tile * 8 + 1)
    n = tl.load(tiles_ptr + tile * 8 + 2)
    pos0 = tl.load(tiles_ptr + tile * 8 + 3)
    lo = tl.load(tiles_ptr + tile * 8 + 4)
    hi = tl.load(tiles_ptr + tile * 8 + 5)
    part = tl.load(tiles_ptr + tile * 8 + 6)
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    tok, g = r // GROUP_P, r % GROUP_P
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    rmask = (tok < n) & (g < GROUP)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (row0 + tok)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif HALF:
        q = q.to(tl.float16)
    q_pos = pos0 + tok
    t = tl.arange(0, TILE)
    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    for first in range(lo, hi, TILE):
        k_pos = first + t
        kvalid = (k_pos < hi) & (k_pos >= 0)
        block = tl.load(tables_ptr + seq * stride_tb + k_pos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        rows = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_mask = kvalid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = kvalid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        seen &= (window <= 0) | (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    if part < 0:
        tl.store(out_ptr + (row0 + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    else:  # a part of a split tile: its rows' output, max and sum into its slot
        at = _slot_rows(part, kvh, r, BLOCK_Q * GROUP_P)
        tl.store(parts_ptr + at[:, None].to(tl.int64) * BLOCK_D + d[None, :], out, mask=rmask[:, None])
        tl.store(ml_ptr + at * 2, m, mask=rmask)
        tl.store(ml_ptr + at * 2 + 1, l_sum, mask=rmask)


@triton.jit
def _slot_rows(slot, kvh, r, ROWS: tl.constexpr):
    """Rows ``r`` of KV head ``kvh`` in scratch slot ``slot`` (parts and their max and sum: ``[slots, kv heads, ROWS]``;
    the launch's second grid axis is the KV heads)."""
    return (slot * tl.num_programs(1) + kvh) * ROWS + r


@triton.jit(do_not_specialize=["stride_ot", "stride_oh"])
def _merge_kernel(parts_ptr, ml_ptr, out_ptr, merges_ptr, stride_ot, stride_oh, GROUP: tl.constexpr,
                  GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    merge = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(merges_ptr + merge * 4)
    if row0 < 0:
        return
    n = tl.load(merges_ptr + merge * 4 + 1)
    first = tl.load(merges_ptr + merge * 4 + 2)
    count = tl.load(merges_ptr + merge * 4 + 3)
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    tok, g = r // GROUP_P, r % GROUP_P
    d = tl.arange(0, BLOCK_D)
    rmask = (tok < n) & (g < GROUP)
    top = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    for i in range(count):
        at = _slot_rows(first + i, kvh, r, BLOCK_Q * GROUP_P)
        top = tl.maximum(top, tl.load(ml_ptr + at * 2, mask=rmask, other=float("-inf")))
    top = tl.where(top > float("-inf"), top, 0.0)
    total = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    for i in range(count):
        at = _slot_rows(first + i, kvh, r, BLOCK_Q * GROUP_P)
        m = tl.load(ml_ptr + at * 2, mask=rmask, other=float("-inf"))
        weight = tl.load(ml_ptr + at * 2 + 1, mask=rmask, other=0.0) * tl.exp(m - top)
        part = tl.load(parts_ptr + at[:, None].to(tl.int64) * BLOCK_D + d[None, :], mask=rmask[:, None], other=0.0)
        acc += part * weight[:, None]
        total += weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    heads = kvh * GROUP + g
    tl.store(out_ptr + (row0 + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])


def attend(q, k_cache, v_cache, tables, tiles, scale: float, window: int = 0, scales=None, out=None,
           merges=None) -> torch.Tensor:
    """``out`` ``[tokens, heads, dim]`` (zeros where none given): each tile's queries over their sequence's keys
    (``tiles`` and ``merges`` as ``cut`` gives them, padded with ``NO_TILE`` and ``NO_MERGE``)."""
    tokens, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    upcast = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)  # the interpreter has no bf16 dot
    fp8, ks, vs = _fp8(k_cache, scales)
    out = torch.zeros_like(q) if out is None else out
    per, group_p, block_d = block_q(heads, kv_heads), triton.next_power_of_2(group), max(triton.next_power_of_2(dim), 16)
    parts = torch.empty(PARTS * kv_heads * per * group_p, block_d, dtype=torch.float32, device=q.device)
    ml = torch.empty(PARTS * kv_heads * per * group_p, 2, dtype=torch.float32, device=q.device)
    _mixed_kernel[(tiles.shape[0], kv_heads)](
        q, k_cache, v_cache, out, tables, tiles, parts, ml, scale * ks, vs, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=per, BLOCK_SIZE=block_size,
        D=dim, BLOCK_D=block_d, TILE=TILE, PRECISION="ieee" if upcast else "tf32",
        UPCAST=upcast, HALF=fp8, num_warps=4, num_stages=2)
    if merges is not None:
        _merge_kernel[(merges.shape[0], kv_heads)](
            parts, ml, out, merges, out.stride(0), out.stride(1), GROUP=group, GROUP_P=group_p, BLOCK_Q=per, D=dim,
            BLOCK_D=block_d, num_warps=4)
    return out
