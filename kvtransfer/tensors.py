"""Moving between torch tensors and the canonical KV byte layout."""
from __future__ import annotations

import ctypes

import torch

from .layout import KVLayout

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items() if v is not None}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no KV wire name") from None


def layout_of(layers: list, num_tokens: int | None = None) -> KVLayout:
    """Describe a list of ``(k, v)`` tensors shaped ``[tokens, kv_heads, head_dim]``."""
    k = layers[0][0]
    tokens, heads, head_dim = k.shape[-3:]
    return KVLayout(len(layers), int(heads), int(head_dim), int(num_tokens or tokens), dtype_name(k.dtype))


def is_mlx(t) -> bool:
    return type(t).__module__.split(".")[0] == "mlx"


def from_mlx(a) -> torch.Tensor:
    """A host tensor over an MLX array's memory (unified memory: no copy when it is contiguous; bf16 too)."""
    import mlx.core as mx
    import numpy as np

    a = mx.contiguous(a)
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.asarray(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(a))


def to_mlx(t: torch.Tensor):
    """An MLX array with a copy of a host tensor's values (same dtype, bf16 too)."""
    import mlx.core as mx

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def to_host(t) -> torch.Tensor:
    """Contiguous CPU tensor (no copy when it already is one; an MLX array becomes a view of its memory)."""
    if is_mlx(t):
        return from_mlx(t)
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.contiguous()


def as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 too).
    The view does not keep ``t`` alive: hold the tensor while using it."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("as_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def check_layer(layout: KVLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    dtype, numel = TORCH_DTYPES[layout.dtype], layout.tensor_nbytes // layout.itemsize
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} does not match layout {layout.dtype}")
        if t.numel() != numel or tuple(t.shape[-3:]) != layout.tensor_shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match layout {layout.tensor_shape}")


def host_layers(layout: KVLayout, layers, phases) -> list:
    """A KV that exists in full, on the host and checked: d2h and serialize timed once for all layers."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"got {len(layers)} layers, layout declares {layout.num_layers}")
    with phases.measure("d2h"):
        host = [(to_host(k), to_host(v)) for k, v in layers]
    with phases.measure("serialize"):
        for k, v in host:
            check_layer(layout, k, v)
    return host


def unpack(buffer: torch.Tensor, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Typed views (no copy) of a byte buffer holding ``layout``."""
    dtype = TORCH_DTYPES[layout.dtype]
    whole = buffer[:layout.total_nbytes].view(dtype).view(layout.num_layers, 2, *layout.tensor_shape)
    return [tuple(pair.unbind(0)) for pair in whole.unbind(0)]


def to_device(layers, device: str | torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy host views onto ``device`` (always a copy, so the host buffer can be reused)."""
    device = torch.device(device)
    copy = [(k.to(device, copy=True), v.to(device, copy=True)) for k, v in layers]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return copy


def materialize(received, device: str | torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Typed tensors on ``device`` (or MLX arrays, ``device="mlx"``) from a ``ReceivedKV``, recording deserialize
    and h2d.

    Where the buffer already lives on ``device`` (host buffers for a CPU decode,
    GPU buffers of the nccl transport) the tensors are views of it and the caller
    releases ``received`` once it no longer needs them; otherwise the buffer is
    copied to ``device`` (h2d) and released here."""
    if received.layers is not None:
        views = received.layers
    else:
        with received.phases.measure("deserialize"):
            views = unpack(received.buffer, received.layout)
    if device == "mlx":
        try:
            with received.phases.measure("h2d"):
                return [(to_mlx(k), to_mlx(v)) for k, v in views]
        finally:
            received.release()
    device = torch.device(device)
    here = views[0][0].device
    if here.type == device.type and (device.index is None or here.index == device.index):
        return views
    try:
        with received.phases.measure("h2d"):
            return to_device(views, device)
    finally:
        received.release()
