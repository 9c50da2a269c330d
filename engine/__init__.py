"""Model runner shared by prefill and decode workers; knows no transport.

The names below load on first use, so that ``engine.prefix_hash`` or ``engine.tokenizer`` (what the router needs)
come without torch."""
from __future__ import annotations

import importlib

_HOMES = {"EngineConfig": ".config", "RequestError": ".errors", "SamplingParams": ".sampling"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
