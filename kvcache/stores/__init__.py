"""Stores a cluster-wide KV pool (``kvcache.pool``) keeps its blocks in. Each has ``put(name, bytes)`` (copies the
bytes before it returns), ``exists(names) -> [bool]`` and ``get(names) -> [bytes-like or None]``."""
from __future__ import annotations


def open_store(kind: str, capacity_blocks: int):
    """The store ``--kv-pool`` names: ``ray`` (the Ray object store of the cluster in ``RAY_ADDRESS``)."""
    if kind == "ray":
        from .ray_store import RayStore

        return RayStore(capacity_blocks)
    raise ValueError(f"--kv-pool {kind!r}: the stores are: ray")
