"""The model's text turned into OpenAI ``tool_calls``.

Forced choices produce a JSON array of ``{"name", "arguments"}``. With
``auto`` the text is read as the model families write calls: Hermes/Qwen
``<tool_call>{...}</tool_call>`` blocks (the text around them stays
content), Mistral ``[TOOL_CALLS]`` followed by a JSON array, Llama 3 a whole
answer that is one JSON object ``{"name", "parameters"|"arguments"}``
(after an optional ``<|python_tag|>``). Only calls of the request's tools
count; anything else stays text."""
from __future__ import annotations

import json
import os
import re

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPENERS = ("[TOOL_CALLS]", "<|python_tag|>", "{")  # calls that must start the answer
INLINE = "<tool_call>"  # calls that may follow some text


class Release:
    """Streaming with ``auto``: the text that can go out now, and what is held because it may be a call."""

    def __init__(self):
        self.sent = ""
        self.held = ""
        self.holding = False

    def add(self, text: str) -> str:
        self.held += text
        if self.holding:
            return ""
        if not self.sent:
            start = self.held.lstrip()
            if any(start.startswith(o) or o.startswith(start) for o in OPENERS):
                self.holding = bool(start) and any(start.startswith(o) for o in OPENERS)
                return ""
        at = self.held.find(INLINE)
        if at >= 0:
            self.holding = True
        else:  # keep a tail that may be the start of the marker
            at = next((i for i in range(max(0, len(self.held) - len(INLINE) + 1), len(self.held))
                       if INLINE.startswith(self.held[i:])), len(self.held))
        out, self.held = self.held[:at], self.held[at:]
        self.sent += out
        return out


def call_id() -> str:
    return "call_" + os.urandom(12).hex()


def _call(obj, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_forced(text: str, names: set[str]) -> list[dict]:
    calls = _json(text)
    out = [_call(c, names) for c in calls] if isinstance(calls, list) else []
    return [c for c in out if c is not None]


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the content left, the calls found)."""
    blocks = HERMES.findall(text)
    if blocks:
        calls = [c for c in (_call(_json(b), names) for b in blocks) if c is not None]
        if calls:
            rest = HERMES.sub("", text).strip()
            return rest or None, calls
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):
        calls = parse_forced(stripped[len("[TOOL_CALLS]"):].strip(), names)
        if calls:
            return None, calls
    body = stripped.removeprefix("<|python_tag|>").strip()
    if body.startswith("{"):
        call = _call(_json(body), names)
        if call is not None:
            return None, [call]
    return text, []
