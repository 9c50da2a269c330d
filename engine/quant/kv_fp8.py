"""The FP8 KV cache (``--kv-cache-dtype fp8``).

The pool stores ``float8_e4m3fn``: a K (or V) value ``x`` is kept as
``fp8(clamp(x / s, -448, 448))`` and read back as ``fp8 * s``, with one scale
``s`` per layer for K and one for V (per tensor: the same for every head, so
a tensor-parallel slice of heads carries the same scales). The scales are the
checkpoint's (``self_attn.k_scale``/``v_scale`` of FP8 checkpoints) or 1.0:
e4m3 keeps 3 mantissa bits at any magnitude from 2^-6 to 448, so the relative
error (about 2.7% RMS per element) does not depend on the scale inside that
range; the scale only keeps values out of overflow. Half the bytes of bf16
per token: twice the sequences in the same pool, half the bytes on every
transport. Prompt tokens attend to their own K/V before it is stored (as the
unquantized cache would); everything read back from the pool is dequantized.

``quantize``/``dequantize`` are the reference forms (torch, any device); the
Triton kernels do the same arithmetic (divide in fp32, round to nearest,
saturate)."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_DTYPES = ("auto", "fp8")


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` / ``scale`` as e4m3 (saturating: torch's own cast turns out-of-range values into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back as ``dtype`` (``x`` of another dtype is only cast)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def store(cache: torch.Tensor, new: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``new`` in the cache's dtype: quantized for an FP8 cache, else cast."""
    return quantize(new, scale or 1.0) if cache.dtype == FP8 else new.to(cache.dtype)


def read(values: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Values read from the pool as ``dtype``."""
    return dequantize(values, scale or 1.0, dtype)


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} not in {KV_DTYPES}")
    return FP8 if name == "fp8" else model_dtype


def put(flat: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``flat.index_copy_(0, slots, values)``, for FP8 too (as bytes: torch has no FP8 index_copy on the CPU)."""
    if flat.dtype == FP8:
        flat, values = flat.view(torch.uint8), values.view(torch.uint8)
    flat.index_copy_(0, slots, values)
