"""Rotary position embeddings (the HF "rotate half" convention), with the
llama3 frequency scaling and linear scaling of ``rope_scaling``."""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class Rotary(torch.nn.Module):
    kernels = None  # ``triton_layers``: one kernel when ``cos``/``sin`` are given

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.args = (head_dim, max_len, theta, scaling)
        self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables where the buffers live (after a model built on the meta device is placed)."""
        head_dim, max_len, theta, scaling = self.args
        device = self.cos.device if self.cos.device.type != "meta" else "cpu"
        with torch.device(device):
            freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_frequencies(head_dim, theta, scaling))
            emb = torch.cat([freqs, freqs], dim=-1)
        if self.cos.device.type != "meta":
            self.cos.copy_(emb.cos())
            self.sin.copy_(emb.sin())

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos=None, sin=None):
        """``q``/``k``: ``[tokens, heads, head_dim]``; ``positions``: ``[tokens]`` (or the tables' rows for them,
        ``cos``/``sin``, gathered once per step)."""
        if self.kernels is not None and cos is not None:
            return self.kernels.rotary(q, k, cos, sin)
        cos = (self.cos[positions] if cos is None else cos).unsqueeze(1).to(q.dtype)
        sin = (self.sin[positions] if sin is None else sin).unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
