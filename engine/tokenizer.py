"""Tokenizers behind one small interface: the built-in byte tokenizer (no
download, identical everywhere) and an adapter over Hugging Face tokenizers."""
from __future__ import annotations

import json

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

    def token_bytes(self, token: int) -> bytes:
        if BYTE_OFFSET <= token < BYTE_OFFSET + 256:
            return bytes([token - BYTE_OFFSET])
        return b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list | None = None) -> list[int]:
        return self.encode(render_plain_chat(messages, add_generation_prompt, continue_final_message, tools))


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
        return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.vocab_size:
            return b""
        piece = self.tok.convert_ids_to_tokens(token)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.tok.decode([token], skip_special_tokens=True).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list | None = None) -> list[int]:
        """Rendered and tokenized in one step: whatever special tokens the template writes are not added again."""
        if not getattr(self.tok, "chat_template", None):
            return self.encode(render_plain_chat(messages, add_generation_prompt, continue_final_message, tools))
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, return_dict=False,
                                           **({"tools": tools} if tools else {}))
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def render_plain_chat(messages: list[dict], add_generation_prompt: bool = True,
                      continue_final_message: bool = False, tools: list | None = None) -> str:
    """The template of models that have none: ``<|role|>`` headers, one turn per line; tools (JSON) in a
    ``<|tools|>`` turn first, an assistant's tool calls as its content."""
    turns = [f"<|tools|>\n{json.dumps(tools, separators=(',', ':'))}\n"] if tools else []
    turns += [f"<|{m['role']}|>\n{m['content'] or _calls_text(m)}\n" for m in messages]
    if continue_final_message:
        turns[-1] = turns[-1][:-1]
    elif add_generation_prompt:
        turns.append("<|assistant|>\n")
    return "".join(turns)


def _calls_text(message: dict) -> str:
    calls = message.get("tool_calls") or []
    return json.dumps([c.get("function", c) for c in calls], separators=(",", ":")) if calls else ""


def save_byte_tokenizer(path, vocab_size: int | None = None) -> str:
    """The byte tokenizer as a Hugging Face tokenizer directory (byte-fallback BPE, no merges), for checkpoints
    built from configs. With ``vocab_size`` the ids past the bytes decode to ``[id]`` (never produced by encoding),
    so a random model's output is text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"<0x{i:02X}>": i + BYTE_OFFSET for i in range(256)}}
    vocab.update({f"[{i}]": i for i in range(len(vocab), vocab_size or 0)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    return str(path)
