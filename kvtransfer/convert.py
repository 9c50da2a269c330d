"""The ``convert`` phase: canonical KV layers from the dtype (and FP8 scales)
they arrived in to the ones the receiving pool keeps. An FP8 element means
``element * scale`` (``layout.py``); converting dequantizes with the sender's
scales and, into an FP8 pool, quantizes with the receiver's (divide, saturate
at 448, round to nearest), so fp8 -> bf16, bf16 -> fp8 and fp8 with other
scales all take the same path. Only arriving KV is converted: a transport
whose layout matches the pool lands its bytes in place."""
from __future__ import annotations

import torch

from .layout import KVLayout
from .tensors import TORCH_DTYPES, dtype_name

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def wire_scales(pairs: list | None) -> tuple | None:
    """A pool's ``[(k_scale, v_scale), ...]`` as a layout's ``scales`` (None: no scales)."""
    return tuple(float(s) for pair in pairs for s in pair) if pairs else None


def layout_for(kv_shape: tuple, tokens: int, dtype: torch.dtype, pairs: list | None = None) -> KVLayout:
    """The canonical layout of ``tokens`` tokens of a pool shaped ``(layers, kv_heads, head_dim)``."""
    layers, heads, head_dim = kv_shape
    return KVLayout(layers, heads, head_dim, tokens, dtype_name(dtype), wire_scales(pairs))


def needs_convert(layout: KVLayout, dtype: torch.dtype, pairs: list | None = None) -> bool:
    """Whether KV in ``layout`` differs from a pool of ``dtype`` (and ``pairs`` scales, FP8) in more than shape."""
    if layout.dtype != dtype_name(dtype):
        return True
    return layout.dtype in FP8_MAX and layout.scale_pairs() != [tuple(map(float, p)) for p in
                                                               (pairs or [(1.0, 1.0)] * layout.num_layers)]


def convert(layers: list, layout: KVLayout, dtype: torch.dtype, pairs: list | None = None) -> list:
    """``layers`` (canonical ``(k, v)`` in ``layout``) as ``dtype`` with the receiver's scales ``pairs``."""
    into = pairs or [(1.0, 1.0)] * layout.num_layers
    return [(_one(k, layout.dtype, sk, dtype, dk), _one(v, layout.dtype, sv, dtype, dv))
            for (k, v), (sk, sv), (dk, dv) in zip(layers, layout.scale_pairs(), into, strict=True)]


def _one(t: torch.Tensor, src: str, src_scale: float, dtype: torch.dtype, dst_scale: float) -> torch.Tensor:
    x = t.float() * src_scale if src in FP8_MAX else t
    name = dtype_name(dtype)
    if name in FP8_MAX:
        return (x.float() / dst_scale).clamp_(-FP8_MAX[name], FP8_MAX[name]).to(TORCH_DTYPES[name])
    return x.to(dtype)
