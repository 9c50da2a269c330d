"""Canonical KV-cache description shared by every transport.

A KV cache for one request is ``num_layers`` layers, each holding a K and a V
tensor of shape ``[num_tokens, num_kv_heads, head_dim]`` in ``dtype``, stored
contiguously (token-major, so a run of whole tokens, e.g. one block of a
paged pool, is one contiguous piece of it). On the wire and in host buffers the layout is fixed: layer 0 K,
layer 0 V, layer 1 K, ... so a byte offset is derivable from the layout alone.
The description is independent of any model library; it travels as a small
dict (msgpack- and JSON-friendly) tagged with ``LAYOUT_VERSION``.

Version 3 adds ``scales``: for an FP8 KV (``float8_e4m3fn``) the value of a
stored element is ``element * scale``, one scale per layer for K and one for V
(``[k0, v0, k1, v1, ...]``; the same for every head, so a slice of heads keeps
them); absent means 1.0. A receiver keeping another dtype or other scales
converts on arrival (``convert``)."""
from __future__ import annotations

from dataclasses import dataclass

LAYOUT_VERSION = 3

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
SCALED = ("float8_e4m3fn", "float8_e5m2")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str
    scales: tuple | None = None  # FP8 only: (k_scale, v_scale) per layer, flattened

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
        if self.scales is not None:
            ok = (self.dtype in SCALED and isinstance(self.scales, tuple) and len(self.scales) == 2 * self.num_layers
                  and all(type(s) is float and 0 < s < float("inf") for s in self.scales))
            if not ok:
                raise LayoutError(f"scales must be {2 * self.num_layers} positive finite floats, for an FP8 dtype "
                                  f"only (dtype {self.dtype!r})")

    def scale_pairs(self) -> list[tuple[float, float]]:
        """``(k_scale, v_scale)`` per layer (1.0 without scales)."""
        s = self.scales or (1.0,) * (2 * self.num_layers)
        return list(zip(s[0::2], s[1::2]))

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
        d = {
            "v": LAYOUT_VERSION,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tokens": self.num_tokens,
            "dtype": self.dtype,
        }
        if self.scales is not None:
            d["scales"] = list(self.scales)
        return d

    @classmethod
    def from_dict(cls, d) -> "KVLayout":
        if not isinstance(d, dict):
            raise LayoutError(f"layout must be a dict, got {type(d).__name__}")
        if d.get("v") != LAYOUT_VERSION:
            raise LayoutError(f"layout version {d.get('v')!r} != {LAYOUT_VERSION}")
        scales = d.get("scales")
        if scales is not None:
            if not isinstance(scales, (list, tuple)) or not all(isinstance(s, (int, float)) for s in scales):
                raise LayoutError("layout scales must be a list of numbers")
            scales = tuple(float(s) for s in scales)
        try:
            return cls(d["layers"], d["kv_heads"], d["head_dim"], d["tokens"], d["dtype"], scales)
        except KeyError as e:
            raise LayoutError(f"layout missing field {e.args[0]!r}") from None
