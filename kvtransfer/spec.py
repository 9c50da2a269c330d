"""A transport's name and config as one JSON text, for a process started to use the same transport (a rank of a
tensor-parallel group): passed in the environment, never on a command line, since it holds the cluster token."""
from __future__ import annotations

import dataclasses
import json

from .base import TransportConfig

ENV = "PDSERVE_TP_TRANSPORT"


def dump(name: str, cfg: TransportConfig) -> str:
    fields = dataclasses.asdict(cfg)
    fields["token"] = cfg.token.hex() if cfg.token else None
    return json.dumps({"name": name, "config": fields})


def load(text: str) -> tuple[str, TransportConfig]:
    spec = json.loads(text)
    fields = spec["config"]
    fields["token"] = bytes.fromhex(fields["token"]) if fields.get("token") else None
    return spec["name"], TransportConfig(**fields)
