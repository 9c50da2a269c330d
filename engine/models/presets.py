"""Model shapes by name (``--load-format dummy --model llama-3-70b``; ``bench.random_checkpoint --shape``): the
Hugging Face config of each, no weights."""
from __future__ import annotations

SHAPES = {
    "llama-3-70b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                        max_position_embeddings=8192, rope_theta=5e5)),
    "qwen2-7b": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                                     rope_theta=1e6)),
    "mistral-7b": ("MistralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         max_position_embeddings=32768, sliding_window=None, rope_theta=1e6)),
    "llama-3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192, rope_theta=5e5)),
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         max_position_embeddings=131072, rope_theta=5e5,
                                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192})),
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       max_position_embeddings=40960, tie_word_embeddings=True)),
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                                           rope_theta=1e6)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, num_experts=128,
                                             num_experts_per_tok=8, norm_topk_prob=True,
                                             max_position_embeddings=40960, rope_theta=1e6)),
    # a prefill forward of 2,000 tokens takes seconds on a CPU while its 64 MB fp32 KV crosses 10 Gbit/s in ~55 ms
    # multi-turn chat on a CPU: a 2,000-token system prompt costs a few hundred ms to prefill, a turn's suffix little
    "chat-cpu": ("LlamaConfig", dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)),
    "stream-cpu": ("LlamaConfig", dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)),
}


def preset_config(name: str, overrides: dict | None = None):
    """The ``transformers`` config of the shape ``name`` (``architectures`` set)."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"no model shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    cls, fields = SHAPES[name]
    config = getattr(transformers, cls)(**{**fields, **(overrides or {})})
    config.architectures = [cls.replace("Config", "ForCausalLM")]
    return config
