"""Reading FP8 checkpoints (``quantization_config`` with ``quant_method`` ``fp8`` or ``compressed-tensors``).

Such a checkpoint stores each projection's weight as e4m3 with a scale: per
tensor (``weight_scale``, one number), per output channel (``weight_scale``,
``[out]`` or ``[out, 1]``), or per 128 x 128 block (``weight_scale_inv``,
DeepSeek-V3 / Qwen3-FP8 style; despite the name, the factor that multiplies).
The loader turns each into the model's dtype as it reads it
(``dequantize``), keeping the checkpoint's scale of each row where there is
one (``row_scales``, on the parameter as ``fp8_row_scale``);
``fp8_linear.quantize_model`` then quantizes on that grid, so per-tensor and
per-channel checkpoints come back to their own FP8 codes (the bf16 value of
a code times its scale is within 2^-9 of it, far inside half an e4m3 step).
A per-block checkpoint is re-quantized per row (within one e4m3 step of its
values). Static activation scales
(``input_scale``) are not used: activations are quantized per token. The KV
cache scales (``self_attn.k_scale``/``v_scale``, or one ``kv_scale``) become
the FP8 KV cache's (``kv_fp8``)."""
from __future__ import annotations

import re

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_METHODS = ("fp8", "compressed-tensors")
_KV_SCALE = re.compile(r"layers\.(\d+)\..*?\b(k|v|kv)_scale$")


def is_fp8_checkpoint(config) -> bool:
    q = getattr(config, "quantization_config", None) or {}
    q = q if isinstance(q, dict) else q.to_dict()
    return q.get("quant_method") in FP8_METHODS


def is_scale(name: str) -> bool:
    return name.endswith(("weight_scale", "weight_scale_inv", "k_scale", "v_scale", "kv_scale", "input_scale"))


def row_scales(weight: torch.Tensor, name: str, scales: dict) -> torch.Tensor | None:
    """The checkpoint's scale of each output row of ``name`` (``[out]``) where it has one per tensor or per row: the
    grid ``fp8_linear`` quantizes on again, so the codes come back as they were; None for per-block scales."""
    s = scales.get(name[: -len("weight")] + "weight_scale")
    if s is None:
        return None
    return s.float().reshape(-1).expand(weight.shape[0]).clone() if s.numel() == 1 else s.float().reshape(-1)


def dequantize(weight: torch.Tensor, name: str, scales: dict, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 checkpoint tensor ``name`` (``....weight``) as ``dtype``, by its scale in ``scales``."""
    base = name[: -len("weight")]
    out, cols = weight.shape
    w = weight.float()
    if base + "weight_scale_inv" in scales:
        s = scales[base + "weight_scale_inv"].float()
        rows_per, cols_per = -(-out // s.shape[0]), -(-cols // s.shape[1])
        s = s.repeat_interleave(rows_per, 0)[:out].repeat_interleave(cols_per, 1)[:, :cols]
    elif base + "weight_scale" in scales:
        s = scales[base + "weight_scale"].float()
        if s.numel() == 1:
            s = s.reshape(())
        elif s.numel() == out:
            s = s.reshape(out, 1)
        else:
            raise ValueError(f"{name}: weight_scale of shape {tuple(s.shape)} is neither per tensor nor per row")
    else:
        raise ValueError(f"{name} is {weight.dtype} but the checkpoint has no {base}weight_scale(_inv)")
    return (w * s).to(dtype)


def kv_scales(scales: dict) -> dict[int, tuple[float, float]]:
    """``{layer: (k_scale, v_scale)}`` from a checkpoint's KV cache scales (1.0 for a missing one)."""
    found: dict[int, dict] = {}
    for name, t in scales.items():
        m = _KV_SCALE.search(name)
        if m:
            value = float(t.float().max())
            kinds = ("k", "v") if m.group(2) == "kv" else (m.group(2),)
            found.setdefault(int(m.group(1)), {}).update({k: value for k in kinds})
    return {layer: (d.get("k", 1.0), d.get("v", 1.0)) for layer, d in found.items()}
