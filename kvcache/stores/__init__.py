"""Stores a cluster-wide KV pool (``kvcache.pool``) keeps its blocks in. Each has ``put(name, bytes)`` (copies the
bytes before it returns), ``exists(names) -> [bool]`` and ``get(names) -> [bytes-like or None]``."""
from __future__ import annotations

SCHEME = "mooncake://"


def open_store(spec: str):
    """The store ``--kv-pool`` names: ``mooncake://HOST:PORT``, Mooncake Store through this host's daemon at that
    address (``pdserve up --kv-pool mooncake`` starts it and gives its workers the address)."""
    if spec.startswith(SCHEME) and ":" in spec[len(SCHEME):]:
        from .mooncake_store import MooncakeStore

        return MooncakeStore(spec[len(SCHEME):])
    if spec == "mooncake":
        raise ValueError("--kv-pool mooncake: `pdserve up` starts the pool's servers; a worker started alone joins "
                         "its host's daemon with --kv-pool mooncake://HOST:PORT")
    raise ValueError(f"--kv-pool {spec!r}: give mooncake (pdserve up) or mooncake://HOST:PORT (a worker)")
