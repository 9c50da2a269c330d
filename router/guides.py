"""Structured-output fields of a request, turned into the one ``guide`` its sampling parameters carry
(``engine.guided.grammars`` compiles it on the worker), and the fields pdserve does not honour yet, refused
with a 400 that names them instead of being ignored.

``response_format``: ``{"type": "text"}`` (no guide), ``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. vLLM's extensions, on both endpoints:
``guided_json`` (a schema, or a JSON string of one), ``guided_choice`` (strings), ``guided_regex``,
``guided_grammar`` (EBNF). At most one of them in a request."""
from __future__ import annotations

import json

REFUSED = {  # field -> why (a request that sets one gets a 400)
    "tools": "tools are for /v1/chat/completions",
    "functions": "functions (deprecated) are not supported: give tools",
    "logit_bias": "logit_bias is not supported",
    "prediction": "predicted outputs are not supported",
}
NEUTRAL = {"tool_choice": ("none", None), "function_call": ("none", None), "parallel_tool_calls": (None, True, False)}
# (on chat completions tools, tool_choice and parallel_tool_calls are fields of their own: router.tools)


def refused_fields(extra: dict) -> list[tuple[str, str]]:
    """Fields of the request that it sets and pdserve cannot honour, each with why."""
    out = [(k, why) for k, why in REFUSED.items() if extra.get(k) not in (None, [], {})]
    out += [(k, f"{k}={extra[k]!r} needs tools, on /v1/chat/completions") for k, ok in NEUTRAL.items()
            if k in extra and extra[k] not in ok]
    return out


def guide_of(response_format, guided_json, guided_choice, guided_regex, guided_grammar) -> dict | None:
    """The guide of these fields (ValueError naming the field when it is malformed or one of several)."""
    given = {k: v for k, v in (("response_format", _from_format(response_format)), ("guided_json", _json(guided_json)),
                               ("guided_choice", _choice(guided_choice)), ("guided_regex", _text("regex", guided_regex)),
                               ("guided_grammar", _text("grammar", guided_grammar))) if v is not None}
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(sorted(given))}, not several")
    return next(iter(given.values()), None)


def _from_format(fmt) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise ValueError("response_format must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema (an object)")
        return {"kind": "json_schema", "value": schema}
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def _json(value) -> dict | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("guided_json must be a JSON schema (an object, or a string of one)") from None
    if not isinstance(value, dict):
        raise ValueError("guided_json must be a JSON schema (an object, or a string of one)")
    return {"kind": "json_schema", "value": value}


def _choice(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")
    return {"kind": "choice", "value": value}


def _text(kind: str, value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"guided_{kind} must be a non-empty string")
    return {"kind": kind, "value": value}
