"""Canonical KV-cache description shared by every transport.

A KV cache for one request is ``num_layers`` layers, each holding a K and a V
tensor of shape ``[num_tokens, num_kv_heads, head_dim]`` in ``dtype``, stored
contiguously (token-major, so a run of whole tokens, e.g. one block of a
paged pool, is one contiguous piece of it; version 2 of the layout). On the wire and in host buffers the layout is fixed: layer 0 K,
layer 0 V, layer 1 K, ... so a byte offset is derivable from the layout alone.
The description is independent of any model library; it travels as a small
dict (msgpack-friendly) tagged with ``LAYOUT_VERSION``.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYOUT_VERSION = 2

DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_TOKENS = 1 << 22


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str

    def __post_init__(self):
        checks = [
            ("num_layers", self.num_layers, 1, MAX_LAYERS),
            ("num_kv_heads", self.num_kv_heads, 1, MAX_HEADS),
            ("head_dim", self.head_dim, 1, MAX_HEAD_DIM),
            ("num_tokens", self.num_tokens, 1, MAX_TOKENS),
        ]
        for name, value, low, high in checks:
            if type(value) is not int or not low <= value <= high:
                raise LayoutError(f"{name}={value!r} must be an int in [{low}, {high}]")
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"unsupported dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def tensor_shape(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def tensor_nbytes(self) -> int:
        return self.num_kv_heads * self.num_tokens * self.head_dim * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.tensor_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def layer_offset(self, layer: int) -> int:
        return layer * self.layer_nbytes

    def to_dict(self) -> dict:
        return {
            "v": LAYOUT_VERSION,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tokens": self.num_tokens,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d) -> "KVLayout":
        if not isinstance(d, dict):
            raise LayoutError(f"layout must be a dict, got {type(d).__name__}")
        if d.get("v") != LAYOUT_VERSION:
            raise LayoutError(f"layout version {d.get('v')!r} != {LAYOUT_VERSION}")
        try:
            return cls(d["layers"], d["kv_heads"], d["head_dim"], d["tokens"], d["dtype"])
        except KeyError as e:
            raise LayoutError(f"layout missing field {e.args[0]!r}") from None
