"""Attention for any mix of decode rows and prompt chunks in one launch, straight over the paged pool, with a grid
fixed by the step's token count (what a CUDA graph of a mixed step captures: ``cuda_graphs.mixed``).

The step's queries ``[tokens, heads, dim]`` are cut into tiles of at most ``BLOCK_Q`` consecutive tokens of one
sequence; a decode row is a tile of one token. ``tiles`` (int32 ``[max tiles, 4]``, on the device) holds per tile
its sequence (a row of ``tables``; -1: no tile, the program returns), its first query row, its token count and the
position of its first token. One program per (tile, KV head) attends the tile's tokens times the group's query
heads (``BLOCK_Q * GROUP`` rows on tensor cores) over the sequence's keys ``[0, last position]`` in tiles of
``TILE`` keys read through the block table, causal (and within a sliding window), online softmax in fp32. An FP8
pool widens as the decode kernel's does (its K scale folded into the softmax scale, its V scale into the output).
Rows of ``out`` that no tile names are left as they were."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import INTERPRETED, _fp8

TILE = 64
ROWS = 64  # query rows of a program: BLOCK_Q tokens times the GQA group (padded to a power of two)


def block_q(heads: int, kv_heads: int) -> int:
    """Tokens per tile for this head layout."""
    return max(1, ROWS // triton.next_power_of_2(heads // kv_heads))


def most_tiles(tokens: int, seqs: int, per_tile: int) -> int:
    """The most tiles ``tokens`` tokens of at most ``seqs`` sequences cut into."""
    return -(-tokens // per_tile) + min(tokens, seqs)


def cut(query_starts: list[int], starts: list[int], per_tile: int) -> list[tuple[int, int, int, int]]:
    """The tiles ``(sequence, first query row, tokens, first position)`` of sequences packed at ``query_starts``
    whose first new token is at position ``starts[i]``."""
    out = []
    for i, pos in enumerate(starts):
        row, end = query_starts[i], query_starts[i + 1]
        for first in range(row, end, per_tile):
            out.append((i, first, min(per_tile, end - first), pos + first - row))
    return out


@triton.jit(do_not_specialize=["scale", "v_scale", "window", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                               "stride_tb"])
def _mixed_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tiles_ptr, scale, v_scale, window,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_tb,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, HALF: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4)
    if seq < 0:
        return
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    n = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)
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
    hi = pos0 + n
    lo = tl.where(window > 0, tl.maximum(pos0 - window + 1, 0), 0)
    lo = lo // TILE * TILE
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
    tl.store(out_ptr + (row0 + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def attend(q, k_cache, v_cache, tables, tiles, scale: float, window: int = 0, scales=None, out=None) -> torch.Tensor:
    """``out`` ``[tokens, heads, dim]`` (zeros where none given): each tile's queries over their sequence's keys."""
    tokens, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    upcast = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)  # the interpreter has no bf16 dot
    fp8, ks, vs = _fp8(k_cache, scales)
    out = torch.zeros_like(q) if out is None else out
    _mixed_kernel[(tiles.shape[0], kv_heads)](
        q, k_cache, v_cache, out, tables, tiles, scale * ks, vs, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), tables.stride(0),
        GROUP=group, GROUP_P=triton.next_power_of_2(group), BLOCK_Q=block_q(heads, kv_heads), BLOCK_SIZE=block_size,
        D=dim, BLOCK_D=max(triton.next_power_of_2(dim), 16), TILE=TILE, PRECISION="ieee" if upcast else "tf32",
        UPCAST=upcast, HALF=fp8, num_warps=4, num_stages=2)
    return out
