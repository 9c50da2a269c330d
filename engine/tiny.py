"""The built-in ``tiny-llama``: Llama architecture from a config dict, weights
drawn from a fixed-seed generator in a fixed order, so every process that
builds it gets the same bits without downloading anything. Its generation
config suppresses every token but printable ASCII bytes and EOS, so its
(random) text is readable."""
from __future__ import annotations

from types import SimpleNamespace

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


class TinyConfig(SimpleNamespace):
    """The fields of ``transformers.LlamaConfig`` the engines read, without importing ``transformers`` (seconds of
    every worker's start-up)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def tiny_config(overrides: dict | None = None) -> TinyConfig:
    c = {**TINY_CONFIG, **(overrides or {})}
    return TinyConfig(**{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False, "mlp_bias": False,
                         "head_dim": c["hidden_size"] // c["num_attention_heads"], **c})


def _shapes(c: TinyConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of Hugging Face's ``LlamaForCausalLM`` of ``c``, by name."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (c.num_attention_heads * d, h),
                       p + "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
                       p + "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return shapes


def tiny_weights(overrides: dict | None = None, seed: int = TINY_SEED) -> tuple[TinyConfig, dict, list[int]]:
    """``(config, state dict, suppressed token ids)``: the same bits as ``build_tiny_model`` (drawn in the same
    order), made without ``transformers``."""
    c = tiny_config(overrides)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(_shapes(c).items()):
        state[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.15
    speakable = _speakable(c)
    state["lm_head.weight" if not c.tie_word_embeddings else "model.embed_tokens.weight"][~speakable] = 0.0
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return c, state, (~speakable).nonzero().flatten().tolist()


def _speakable(c) -> torch.Tensor:
    speakable = torch.zeros(c.vocab_size, dtype=torch.bool)
    speakable[BYTE_OFFSET + 32:BYTE_OFFSET + 127] = True
    speakable[c.eos_token_id] = True
    return speakable


def build_tiny_model(overrides: dict | None = None, seed: int = TINY_SEED):
    """The tiny model as ``transformers``' own ``LlamaForCausalLM`` (the reference the tests hold the engines to),
    with ``tiny_weights`` (every name and shape must match: strict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **(overrides or {})}))
    _, state, suppress = tiny_weights(overrides, seed)
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    model.generation_config.suppress_tokens = suppress
    return model.eval()
