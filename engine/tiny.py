"""The built-in ``tiny-llama``: Llama architecture from a config dict, weights
drawn from a fixed-seed generator in a fixed order, so every process that
builds it gets the same bits without downloading anything. Its generation
config suppresses every token but printable ASCII bytes and EOS, so its
(random) text is readable."""
from __future__ import annotations

import torch

from .config import TINY
from .tokenizer import BYTE_OFFSET

TINY_NAME = TINY
TINY_SEED = 1234
TINY_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def build_tiny_model(overrides: dict | None = None, seed: int = TINY_SEED):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_CONFIG, **(overrides or {})})
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        speakable = torch.zeros(config.vocab_size, dtype=torch.bool)
        speakable[BYTE_OFFSET + 32:BYTE_OFFSET + 127] = True
        speakable[config.eos_token_id] = True
        model.lm_head.weight[~speakable] = 0.0
    model.generation_config.suppress_tokens = (~speakable).nonzero().flatten().tolist()
    return model.eval()
