"""Tokenizers behind one small interface: the built-in byte tokenizer (no
download, identical everywhere) and an adapter over Hugging Face tokenizers."""
from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids; BOS is prepended on encode."""

    vocab_size = 256 + BYTE_OFFSET
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return turns + "<|assistant|>\n"


class HFTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.tok)
        self.bos_token_id = self.tok.bos_token_id
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return ByteTokenizer.apply_chat_template(self, messages)
