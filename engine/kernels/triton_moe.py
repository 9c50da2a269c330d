"""The mixture-of-experts block as grouped GEMMs in Triton (CUDA; ``models.moe`` runs it when the engine has the
kernels), with fixed shapes for a given token count, so a decode CUDA graph captures it.

A batch of a few tokens (pairs at most half the experts) gets a block per pair instead (``one_pair_blocks``).
Otherwise ``align`` (torch, no host synchronization) sorts the ``tokens * top_k`` (token, expert) pairs by expert and pads
each expert's run to a multiple of ``BLOCK_M``: ``slots`` lists pair ids in that order (``pairs`` marks padding),
``block_expert`` gives each ``BLOCK_M`` block its expert (-1: past the end). ``_moe_gemm`` then runs one program per
(block, ``BLOCK_N`` output columns): the block's rows gathered (``x[pair // top_k]`` for gate/up, the pair's own row
for down), times its expert's weight tile, written back to the pairs' rows, the routing weight applied after down.
Between the two GEMMs, SiLU-times-up (``triton_layers``); after them, each token's ``top_k`` rows summed. Each
expert's weights are read once per block of its tokens: once per step at decode, whichever tokens chose it."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_layers import silu_mul

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` ``[tokens, top_k]`` -> ``(slots [capacity], block_expert [capacity // block_m])``; a fixed
    ``capacity`` (every expert's run padded) so the shapes depend on the token count only."""
    pairs = ids.numel()
    flat = ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    pos = torch.arange(pairs, device=ids.device) - first[sorted_e] + (ends - padded)[sorted_e]
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    slots = torch.full((capacity,), pairs, dtype=torch.int64, device=ids.device).scatter_(0, pos, order)
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    return slots, torch.where(block_expert < num_experts, block_expert, -1)


@triton.jit
def _moe_gemm(a_ptr, w_ptr, out_ptr, slots_ptr, experts_ptr, weights_ptr, pairs, stride_am, stride_we, stride_om,
              N: tl.constexpr, K: tl.constexpr, DIVIDE: tl.constexpr, WEIGH: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block)
    if expert >= 0:
        rows = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < pairs
        a_rows = rows // DIVIDE  # gate/up: the token of the pair; down: the pair's own row
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        kk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            kmask = k < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_base + n[None, :].to(tl.int64) * K + k[:, None], mask=nmask[None, :] & kmask[:, None],
                        other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if WEIGH:
            acc = acc * tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


def one_pair_blocks(ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block per (token, expert) pair, nothing sorted: for a batch of a few tokens, whose pairs rarely share an
    expert (the sort and its dozen small launches cost more than reading an expert twice)."""
    pairs = ids.numel()
    slots = torch.full((pairs, block_m), pairs, dtype=torch.int64, device=ids.device)
    slots[:, 0] = torch.arange(pairs, device=ids.device)
    return slots.flatten(), ids.flatten()


def block_m_for(tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per block: 16 (the tensor cores' least) while experts see a few tokens each, 64 for prompts."""
    return 16 if tokens * top_k <= 4 * num_experts else 64


def _gemm(a, w, out, slots, experts, weights, pairs, divide, weigh, block_m):
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else 32
    grid = (experts.numel(), triton.cdiv(n, block_n))
    fp32 = a.dtype == torch.float32
    _moe_gemm[grid](a, w, out, slots, experts, weights, pairs, a.stride(0), w.stride(0), out.stride(0), N=n, K=k,
                    DIVIDE=divide, WEIGH=weigh, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if block_m > 16 else 128,
                    UPCAST=INTERPRETED or fp32, num_warps=4, num_stages=3 if block_m > 16 else 4)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
    """``models.moe.experts_reference``'s result: ``x`` ``[tokens, hidden]``, ``weights``/``ids`` ``[tokens,
    top_k]``, ``w_gate_up`` ``[E, 2 * inter, hidden]``, ``w_down`` ``[E, hidden, inter]``."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    block_m = block_m_for(tokens, top_k, w_gate_up.shape[0])
    if pairs * 2 <= w_gate_up.shape[0]:
        slots, block_expert = one_pair_blocks(ids, block_m)
    else:
        slots, block_expert = align(ids, w_gate_up.shape[0], block_m)
    x = x.contiguous()
    gate_up = torch.empty(pairs, w_gate_up.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, w_gate_up, gate_up, slots, block_expert, weights, pairs, top_k, False, block_m)
    act = silu_mul(gate_up)
    down = torch.empty(pairs, w_down.shape[1], dtype=torch.float32 if weights.dtype == torch.float32 else x.dtype,
                       device=x.device)
    _gemm(act, w_down, down, slots, block_expert, weights.reshape(-1).contiguous(), pairs, 1, True, block_m)
    return down.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
