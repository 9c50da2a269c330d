"""OpenAI response bodies and SSE chunks for completions and chat completions.

Logprobs arrive from workers as ``{"t": text, "b": bytes, "lp": logprob,
"top": [[text, bytes, logprob], ...]}`` per token and are shaped here:
completions get ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``,
chat gets ``content[]`` with ``token``/``logprob``/``bytes``/``top_logprobs``."""
from __future__ import annotations

import json
import math
import time

from .choice import Choice

FLOOR = -9999.0


def _lp(v):
    return None if v is None else (FLOOR if math.isinf(v) or math.isnan(v) else v)


class Shaper:
    def __init__(self, kind: str, rid: str, model: str, logprobs: bool = False):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = logprobs
        self.running_usage = False
        self._frames: dict[int, tuple[bytes, bytes]] = {}

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries: list | None, choice: Choice) -> dict | None:
        """The logprobs object for these tokens, advancing the choice's text offset (completions)."""
        if not self.with_logprobs:
            return None
        entries = entries or []
        if self.chat:
            def item(t, b, lp):
                return {"token": t, "logprob": _lp(lp), "bytes": list(b)}

            return {"content": [{**item(e["t"], e["b"], e["lp"]), "top_logprobs": [item(*x) for x in e["top"]]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(choice.offset)
            choice.offset += len(e["t"])
        return {"tokens": [e["t"] for e in entries], "token_logprobs": [_lp(e["lp"]) for e in entries],
                "top_logprobs": [{t: _lp(lp) for t, _, lp in e["top"]} if e["lp"] is not None else None for e in entries],
                "text_offset": offsets}

    def chunk(self, choice: Choice, text: str | None, finish_reason: str | None = None, role: bool = False,
              ids=None, logprobs=None) -> dict:
        lp = self.logprobs(logprobs, choice) if logprobs is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            body = {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            body = {"index": choice.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            obj = "text_completion"
        if ids is not None:
            body["token_ids"] = ids
        return {**self._base(obj), "choices": [body]}

    def tool_call_chunks(self, choice: Choice, pieces: int = 2) -> list[dict]:
        """The tool calls of ``choice`` as OpenAI streams them: per call a delta with its index, id, type and name,
        then its arguments in ``pieces`` deltas."""
        out = []
        for i, call in enumerate(choice.tool_calls or []):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            out.append(self._tool_delta(choice, head))
            args = call["function"]["arguments"]
            step = max(1, -(-len(args) // pieces))
            for at in range(0, len(args), step):
                out.append(self._tool_delta(choice, {"index": i, "function": {"arguments": args[at:at + step]}}))
        return out

    def _tool_delta(self, choice: Choice, call: dict) -> dict:
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": choice.index, "delta": {"tool_calls": [call]}, "logprobs": None,
                             "finish_reason": None}]}

    def text_event(self, choice: Choice, text: str) -> bytes:
        """``sse(self.chunk(choice, text))`` for a chunk of text alone (the usual token), from a prepared frame."""
        frame = self._frames.get(choice.index)
        if frame is None:
            parts = sse(self.chunk(choice, "\0")).split(json.dumps("\0").encode())
            if len(parts) != 2:  # the id or model holds a NUL too: no frame
                return sse(self.chunk(choice, text))
            frame = self._frames[choice.index] = (parts[0], parts[1])
        return frame[0] + json.dumps(text).encode() + frame[1]

    def usage_chunk(self, usage: dict, timing: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage, "pdserve": timing}

    def full(self, choices: list[Choice], usage: dict, with_ids: bool) -> dict:
        out = []
        for c in choices:
            lp = self.logprobs(c.logprobs, c)
            if self.chat:
                message = {"role": "assistant", "content": "".join(c.text)}
                if c.tool_calls:
                    message = {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
                body = {"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                body = {"index": c.index, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason}
            if with_ids:
                body["token_ids"] = c.ids
            if len(choices) > 1:
                body["pdserve"] = c.timing
            out.append(body)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._base(obj), "choices": out, "usage": usage, "pdserve": choices[0].timing}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
