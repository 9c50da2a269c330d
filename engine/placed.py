"""A KV cache whose prefill lands in memory chosen by the caller.

Each layer's first update copies K and V into the given ``[kv_heads, tokens,
head_dim]`` destinations (the copy any cache makes when it stores new states)
and keeps those as its storage, so the prompt's KV ends up where a transport
can send it from without another copy. Later updates, or states that do not
fit the destination, fall back to the ordinary growing cache."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PlacedLayer(DynamicLayer):
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.dest = (k, v)

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = self.dest or (None, None)
        self.dest = None
        fits = (k is not None and not self.is_initialized and key_states.shape[0] == 1
                and key_states.shape[1:] == k.shape == value_states.shape[1:] and key_states.dtype == k.dtype
                and key_states.device == k.device)
        if not fits:
            return super().update(key_states, value_states, *args, **kwargs)
        k.copy_(key_states[0])
        v.copy_(value_states[0])
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True
        self.keys, self.values = k.unsqueeze(0), v.unsqueeze(0)
        return self.keys, self.values


def placed_cache(into: list) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [PlacedLayer(k, v) for k, v in into]
    cache.layer_class_to_replicate = None
    return cache
