"""Attention of a prompt chunk that follows a prefix already in the pool, as two fused calls merged exactly.

The chunk's queries see every prefix key (no mask) and their own keys causally. One call with a mask over the whole
context keeps SDPA off its fastest kernels (a boolean mask: the memory-efficient one; FlashAttention's bottom-right
causal mode: ~340 TFLOP/s on an H200 where cuDNN's plain modes reach ~600). So the chunk attends to the prefix with
no mask and to itself with ``is_causal``, each call returning its rows' log-sum-exp, and the two outputs are
weighted by them: ``o = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m))``, ``m = max(l1, l2)``, which
is the softmax over all the keys. Measured by ``bench.lab.prefix_attention`` (bench/RESULTS.md).

``attend(q, k, v, prefix, scale, op)``: ``q`` ``[heads, queries, dim]``, ``k``/``v`` ``[heads, prefix + queries,
dim]`` (heads already repeated to the queries'); ``op``: ``cudnn`` (CUDA) or ``cpu`` (torch's CPU flash kernel: the
same merge, for tests)."""
from __future__ import annotations

import os

import torch

# cuDNN builds a plan for every new pair of lengths (tens of ms each), and a served trace's chunks rarely repeat one:
# its ragged mode takes any length with one plan, for token-major (BSHD) tensors, which is how these are laid out.
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")


def _fused(q, k, v, causal: bool, scale: float, op: str):
    """One fused attention call over ``[1, heads, n, dim]`` tensors: its output and its rows' log-sum-exp."""
    if op == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1].float().reshape(out[0].shape[:3])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float, op: str) -> torch.Tensor:
    q4, k4, v4 = q[None], k[None], v[None]
    o1, l1 = _fused(q4, k4[:, :, :prefix], v4[:, :, :prefix], False, scale, op)
    o2, l2 = _fused(q4, k4[:, :, prefix:], v4[:, :, prefix:], True, scale, op)
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp_()[..., None], (l2 - top).exp_()[..., None]
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)[0]


def usable(device: torch.device, dtype: torch.dtype, window: int | None) -> bool:
    """Whether a chunk after a prefix takes this path: on CUDA in half precision (what cuDNN's kernel takes), no
    sliding window (its mask is not causal)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not window
