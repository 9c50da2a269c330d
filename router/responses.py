"""OpenAI response bodies and SSE chunks for completions and chat completions."""
from __future__ import annotations

import json
import time


class Shaper:
    def __init__(self, kind: str, rid: str, model: str):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False, ids=None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        if ids is not None:
            choice["token_ids"] = ids
        return {**self._base(obj), "choices": [choice]}

    def usage_chunk(self, usage: dict, timing: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage, "pdserve": timing}

    def full(self, text: str, finish_reason: str, usage: dict, timing: dict, ids=None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        if ids is not None:
            choice["token_ids"] = ids
        return {**self._base(obj), "choices": [choice], "usage": usage, "pdserve": timing}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
