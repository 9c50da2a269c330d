"""KV payload shapes from real models."""
from __future__ import annotations

import torch

from kvtransfer import KVLayout
from kvtransfer.tensors import TORCH_DTYPES

PRESETS = {
    "tiny": KVLayout(4, 2, 16, 64, "float32"),
    "mistral-7b@871": KVLayout(32, 8, 128, 871, "float16"),
    "mistral-7b-fp8@871": KVLayout(32, 8, 128, 871, "float8_e4m3fn", (1.0,) * 64),  # --kv-cache-dtype fp8
    "llama3-8b@4096": KVLayout(32, 8, 128, 4096, "float16"),
    "llama3-70b@8192": KVLayout(80, 8, 128, 8192, "bfloat16"),
}


def layout_from_args(args) -> KVLayout:
    if args.layers:
        return KVLayout(args.layers, args.kv_heads, args.head_dim, args.tokens, args.dtype)
    try:
        return PRESETS[args.preset]
    except KeyError:
        raise SystemExit(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}") from None


def as_fp8(layout: KVLayout) -> KVLayout:
    """The same KV as an FP8 cache holds it (e4m3, scales 1.0): half the bytes of fp16/bf16."""
    import dataclasses

    return dataclasses.replace(layout, dtype="float8_e4m3fn", scales=(1.0,) * (2 * layout.num_layers))


def make_kv(layout: KVLayout, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[layout.dtype]

    def one():
        return torch.randn(layout.tensor_shape, generator=gen).to(dtype)
    return [(one(), one()) for _ in range(layout.num_layers)]
