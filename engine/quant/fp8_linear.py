"""FP8 weights (``--quantization fp8``): W8A8 with e4m3 on both sides.

Each weight row (output channel) is stored as ``fp8(w / s_row)`` with
``s_row = max|w_row| / 448``; each activation row (token) is quantized the
same way on the fly (dynamic per-token scales), and ``torch._scaled_mm``
multiplies the two FP8 operands on the tensor cores, applying both scale
vectors in its epilogue: ``y[t, o] = (xq[t] . wq[o]) * s_x[t] * s_w[o]``.
Half the weight bytes of bf16, so a decode step that reads every weight once
takes about half the time at small batch. The q/k/v, o, gate/up and down
projections are quantized; embeddings, norms and the LM head stay in the
model's dtype (as vLLM and SGLang keep them). Under tensor parallelism each
rank quantizes its own shard (row scales are per output channel, so a
column-parallel shard's scales are its rows', a row-parallel shard's its own).

``quantize_rows`` is the torch reference of the per-row quantization;
``kernels.triton_quant`` does the activations in one launch on CUDA, and the
RMSNorm kernels before q/k/v and gate/up write their output quantized
(``Quantized``), so no launch is spent on it there. A
batch of a few rows (decode at small batch) goes to ``kernels.triton_fp8``
instead of cuBLAS: the same products, tiles sized for few rows."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .kv_fp8 import FP8, FP8_MAX

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ALLOW_CPU = False  # tests run the layers on the CPU (torch has _scaled_mm there); serving refuses: see check_device
MIN_SCALE = 1e-12


def check_device(device: torch.device) -> None:
    """FP8 GEMMs need an FP8 tensor-core GPU (compute capability 8.9+: Ada, Hopper, Blackwell)."""
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"--quantization fp8 needs compute capability 8.9+ (Ada, Hopper or newer); "
                             f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
        return
    if not ALLOW_CPU:
        raise ValueError(f"--quantization fp8 runs on CUDA GPUs only (FP8 tensor cores), not on {device.type}: drop "
                         "--quantization, or serve the model on a GPU")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 rows, fp32 scale per row [rows, 1])``: each row divided by its max|x| / 448."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Quantized(NamedTuple):
    """Activations already in e4m3 (``values`` ``[..., K]``) with their per-row ``scales`` ``[rows, 1]``: what a
    fused RMSNorm kernel hands the FP8 projection after it (``triton_layers.rmsnorm_fp8``)."""
    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype  # what the projection returns (the model's dtype)


class Fp8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` as FP8 rows and their scales; a row-parallel shard all-reduces after."""

    quantize_activations = staticmethod(quantize_rows)  # ``triton_quant.quantize_rows`` on CUDA (``engine.fp8_kernels``)
    few_rows = None  # ``triton_fp8.w8_matmul`` on CUDA: batches of at most ``few_rows_max`` rows
    few_rows_max = 0

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"FP8 GEMMs need both sides a multiple of 16, not {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] e4m3
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1))  # [1, out]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    @classmethod
    def of(cls, linear: nn.Linear) -> "Fp8Linear":
        """``linear`` (its rank's shard) quantized per output channel: on an FP8 checkpoint's own grid where the
        loader kept it (``fp8_row_scale``: its codes come back), else max|row| / 448."""
        rows = getattr(linear.weight, "fp8_row_scale", None)
        if rows is not None:
            scale = rows.to(linear.weight.device).reshape(-1, 1)
            q = (linear.weight.data.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            q, scale = quantize_rows(linear.weight.data)
        bias = linear.bias.data if linear.bias is not None else None
        return cls(q, scale, bias, getattr(linear, "group", None))

    def forward(self, x) -> torch.Tensor:
        """``x``: activations in the model's dtype, or ``Quantized`` ones."""
        if isinstance(x, Quantized):
            shape, dtype = x.values.shape, x.dtype
            xq, xs = x.values.reshape(-1, self.in_features), x.scales
        else:
            shape, dtype = x.shape, x.dtype
            xq, xs = self.quantize_activations(x.reshape(-1, self.in_features))
        if self.few_rows is not None and xq.shape[0] <= self.few_rows_max:
            y = self.few_rows(xq, self.weight, self.weight_scale, x_scale=xs, out_dtype=dtype)
        else:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=dtype)
        if self.bias is not None:
            y = y + self.bias
        y = y.reshape(*shape[:-1], self.out_features)
        return self.group.all_reduce(y) if self.group is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 rows"


def quantize_model(model: nn.Module) -> int:
    """Replace every fused projection of ``model``'s layers with its FP8 form (after ``fuse``); returns how many."""
    count = 0
    for layer in model.owned_layers:
        for parent in (layer.self_attn, layer.ffn):  # a sparse block's experts stay in the model's dtype
            for name in TARGETS:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    setattr(parent, name, Fp8Linear.of(linear))
                    count += 1
    return count
