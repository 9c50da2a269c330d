"""Local Hugging Face checkpoint directories built from config dicts (no downloads)."""
from __future__ import annotations

from engine.tiny import build_tiny_model

# big enough that a long prompt keeps a CPU thread busy for a second or more
SLOW = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=4096)


def write_checkpoint(path, overrides: dict | None = None) -> str:
    build_tiny_model(overrides).save_pretrained(path)
    return write_tokenizer(path)


def write_tokenizer(path) -> str:
    """The byte tokenizer as a Hugging Face tokenizer directory (byte-fallback BPE, no merges)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": i + 3 for i in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    return str(path)
