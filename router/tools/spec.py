"""A request's tools, checked, and what its ``tool_choice`` asks of the model.

``tool_choice``: ``none`` (tools not rendered, no calls), ``auto`` (the
default with tools: the template renders them, the model may call; its text
is parsed for calls, ``tools.parse``), ``required`` or a named function
(``{"type": "function", "function": {"name": ...}}``): forced by a grammar:
the model's whole answer is a JSON array of ``{"name", "arguments"}`` calls
(at least one; one at most when ``parallel_tool_calls`` is false), each
``arguments`` following its function's ``parameters`` schema."""
from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_CALLS = 16  # calls in one forced answer (a model that never closes its array still ends)
ANY_OBJECT = {"type": "object"}


def check_tools(tools) -> list[dict]:
    """The tools as plain function specs ``{"name", "description", "parameters"}`` (ValueError when malformed)."""
    if not isinstance(tools, list) or not tools or len(tools) > 128:
        raise ValueError("tools must be a list of 1 to 128 function tools")
    out, names = [], set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise ValueError("each tool must be {type: function, function: {name: [A-Za-z0-9_.-]{1,64}, ...}}")
        params = fn.get("parameters", ANY_OBJECT)
        if not isinstance(params, dict):
            raise ValueError(f"tool {fn['name']}: parameters must be a JSON schema object")
        if fn["name"] in names:
            raise ValueError(f"tool {fn['name']} is given twice")
        names.add(fn["name"])
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    return out


def choice_mode(tool_choice, tools: list[dict] | None) -> tuple[str | None, str | None]:
    """(``none`` | ``auto`` | ``forced``, the function a named choice forces)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ("forced" if tool_choice == "required" else tool_choice), None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice must be none, auto, required or {type: function, function: {name}}")
    if name not in {t["name"] for t in tools or []}:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return "forced", name


def forced_guide(tools: list[dict], name: str | None, parallel: bool) -> dict:
    """The JSON-schema guide of a forced choice: an array of calls of the allowed functions."""
    allowed = [t for t in tools if name is None or t["name"] == name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]}} for t in allowed]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": items, "minItems": 1, "maxItems": MAX_CALLS if parallel else 1}
    return {"kind": "json_schema", "value": schema}
