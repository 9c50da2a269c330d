"""The Ray object store as a KV pool: blocks are Ray objects, found through one named, detached index actor.

``put`` puts the bytes in the local node's object store (``ray.put``, a copy) and registers the reference with the
index (``pdserve-kv-pool`` in namespace ``pdserve``), which holds at most ``capacity_blocks`` of them and lets the
least recently used go (Ray then frees the object). ``get`` asks the index for the references of a run of names
and reads them; Ray moves each object to the reader's node, spilling to disk under memory pressure. An object whose
owner (the worker that put it) died is gone: ``get`` answers None from there on. Connects to ``RAY_ADDRESS``."""
from __future__ import annotations

import os
from collections import OrderedDict

import ray

NAMESPACE = "pdserve"
INDEX = "pdserve-kv-pool"


@ray.remote(num_cpus=0)
class Index:
    def __init__(self, capacity: int):
        self.capacity, self.refs = capacity, OrderedDict()

    def add(self, name: str, wrapped: list) -> None:
        self.refs[name] = wrapped[0]
        self.refs.move_to_end(name)
        while len(self.refs) > self.capacity:
            self.refs.popitem(last=False)

    def has(self, names: list[str]) -> list[bool]:
        return [n in self.refs for n in names]

    def lookup(self, names: list[str]) -> list[list]:
        out = []
        for n in names:
            ref = self.refs.get(n)
            if ref is None:
                break
            self.refs.move_to_end(n)
            out.append(ref)
        return [out]  # wrapped: the caller gets the references, not the values


class RayStore:
    def __init__(self, capacity_blocks: int):
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE, logging_level="WARNING",
                     log_to_driver=False)
        self.index = Index.options(name=INDEX, namespace=NAMESPACE, lifetime="detached",
                                   get_if_exists=True).remote(capacity_blocks)

    def put(self, name: str, data) -> None:
        ray.get(self.index.add.remote(name, [ray.put(data)]))

    def exists(self, names: list[str]) -> list[bool]:
        return ray.get(self.index.has.remote(names)) if names else []

    def get(self, names: list[str]) -> list:
        refs = ray.get(self.index.lookup.remote(names))[0] if names else []
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=30))
            except (ray.exceptions.RayError, TimeoutError):  # its owner died, or it was lost
                break
        return out + [None] * (len(names) - len(out))
