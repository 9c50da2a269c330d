"""Local Hugging Face checkpoint directories built from config dicts (no downloads)."""
from __future__ import annotations

from engine.tiny import build_tiny_model
from engine.tokenizer import save_byte_tokenizer

# big enough that a long prompt keeps a CPU thread busy for a second or more
SLOW = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=4096)


def write_checkpoint(path, overrides: dict | None = None) -> str:
    build_tiny_model(overrides).save_pretrained(path)
    return write_tokenizer(path)


def write_tokenizer(path) -> str:
    return save_byte_tokenizer(path)
