"""The router's view of a prompt's token ids, for KV-aware routing and for
``--disagg auto``'s decisions (``PromptTokenizer``): the
same tokenizer the workers use (the built-in byte tokenizer, or a Hugging
Face ``tokenizer.json`` read with ``tokenizers`` and its chat template
rendered with ``jinja2``, so the router never imports torch). A prompt the
router tokenizes differently from the worker only routes worse: the workers
check every reused block against their own token ids."""
from __future__ import annotations

import asyncio
import json
import logging
import os

from engine.prefix_hash import block_hashes
from engine.tokenizer import ByteTokenizer, render_plain_chat

log = logging.getLogger(__name__)


class HFTokens:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.template = config.get("chat_template")
        self.special = {k: _text(config.get(k)) for k in ("bos_token", "eos_token")}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos).ids

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False) -> list[int]:
        if not self.template:
            return self.encode(render_plain_chat(messages, add_generation_prompt, continue_final_message))
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **self.special)
        return self.encode(text, add_bos=False)


def _text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


def load_tokens(spec: str | None):
    """``builtin``, a local checkpoint directory with a ``tokenizer.json``, or None (when it cannot be used)."""
    if spec == "builtin":
        return ByteTokenizer()
    if spec and os.path.exists(os.path.join(spec, "tokenizer.json")):
        try:
            return HFTokens(spec)
        except Exception as e:  # routing falls back to load only
            log.warning("KV-aware routing cannot read the tokenizer in %s: %s", spec, e)
    return None


class PromptKeys:
    """One request's token ids, and its block keys per (block size, model) asked for."""

    def __init__(self, ids: list[int] | None):
        self.ids = ids
        self._keys: dict = {}

    def keys(self, block_size: int, salt: str) -> list[int]:
        if not self.ids or block_size < 1:
            return []
        key = (block_size, salt)
        if key not in self._keys:
            self._keys[key] = block_hashes(self.ids, block_size, salt, limit=(len(self.ids) - 1) // block_size)
        return self._keys[key]


def prompt_ids(tokens, payload: dict) -> list[int] | None:
    if tokens is None:
        return None
    try:
        if payload.get("messages") is not None:
            options = payload.get("chat") or {}
            return tokens.apply_chat_template(payload["messages"], bool(options.get("add_generation_prompt", True)),
                                              bool(options.get("continue_final_message", False)))
        prompt = payload.get("prompt")
        if isinstance(prompt, list):
            return prompt
        return tokens.encode(prompt) if isinstance(prompt, str) else None
    except Exception as e:
        log.debug("cannot tokenize a prompt for routing: %s", e)
        return None


class PromptTokenizer:
    """The tokenizer the router uses: the one configured (``--tokenizer``), else the one the first healthy worker
    reports, loaded once when first needed."""

    def __init__(self, spec: str | None, groups: dict):
        self.spec, self.groups = spec, groups
        self._tokens, self._tried = None, False

    def tokens(self):
        if not self._tried:
            spec = self.spec or next((c.info["tokenizer"] for g in self.groups.values() for c in g.healthy()
                                      if c.info.get("tokenizer")), None)
            if spec is None:
                return None
            self._tokens, self._tried = load_tokens(spec), True
            if self._tokens is None:
                log.warning("kv_aware routing has no tokenizer (%s is not readable here; give --tokenizer): "
                            "it balances load only", spec)
        return self._tokens

    async def keys(self, payload: dict) -> PromptKeys:
        """The prompt's ids (None where no tokenizer is usable), tokenized off the event loop."""
        tokens = self.tokens()
        return PromptKeys(await asyncio.to_thread(prompt_ids, tokens, payload) if tokens is not None else None)
