"""ModelRunner: the forward passes both worker kinds share. KV leaves and
enters as a list of ``(k, v)`` per layer, each ``[kv_heads, tokens, head_dim]``;
``prefill(..., into=...)`` writes the prompt's KV into caller-given tensors of
that shape (``kv_shape`` says which) instead of fresh ones."""
from __future__ import annotations

import torch

from .config import EngineConfig
from .loader import load
from .placed import placed_cache


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model, self.tokenizer, self.name, self.max_len, self.device, self.dtype = load(cfg)
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.kv_bytes_per_token = c.num_hidden_layers * 2 * kv_heads * head_dim * self.dtype.itemsize
        self.kv_shape = (c.num_hidden_layers, kv_heads, head_dim)
        suppress = getattr(getattr(self.model, "generation_config", None), "suppress_tokens", None)
        self.suppress = torch.tensor(suppress, device=self.device) if suppress else None

    def _logits(self, out, every: bool = False) -> torch.Tensor:
        """Next-token scores (of the last position, or ``[tokens, vocab]`` of every one); tokens the model's
        generation config suppresses score -inf."""
        logits = (out.logits[0] if every else out.logits[0, -1]).float()
        if self.suppress is not None:
            logits[..., self.suppress] = float("-inf")
        return logits

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], into: list | None = None, every: bool = False):
        """``(logits, kv)``; ``every`` gives the logits of every prompt position (for prompt logprobs)."""
        ids = torch.tensor([token_ids], device=self.device)
        cache = placed_cache(into) if into is not None else None
        kwargs = {} if every else {"logits_to_keep": 1}
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
        kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
        return self._logits(out, every), kv

    def cache_from(self, kv):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k.unsqueeze(0).to(self.device), v.unsqueeze(0).to(self.device), i)
        return cache

    @torch.inference_mode()
    def step(self, cache, token_id: int) -> torch.Tensor:
        ids = torch.tensor([[token_id]], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return self._logits(out)
