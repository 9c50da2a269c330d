"""Mooncake Store as the KV pool: a worker is a client of its host's ``mooncake_client`` daemon, which mounts the
host's segment of the store and serves it over Mooncake's transfer engine; ``mooncake_master`` keeps the index of
every segment's blocks (``kvcache.servers`` starts both).

The worker's client (``setup_dummy``) shares a memory pool with the daemon: a block goes in by being copied into a
buffer of that pool and put from there (``batch_put_from``), and comes out by being read into it
(``batch_get_into``) and copied out. Blocks live in the daemon's segment, so they outlive the worker that wrote
them; the master evicts the least recently used when the segment fills. Calls are serialized (one client a
worker, used by the engine's thread and the pool's publisher)."""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

os.environ.setdefault("GLOG_minloglevel", "3")  # the client library's own log lines (errors come back as codes)

BUFFER_BYTES = 64 << 20  # the shared buffer a worker puts from and reads into
POOL_BYTES = 256 << 20  # the worker's memory pool shared with the daemon (the buffer is allocated in it)


class MooncakeStore:
    def __init__(self, address: str):
        """``address``: the host's daemon, ``HOST:PORT``."""
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if (rc := self.store.setup_dummy(POOL_BYTES, BUFFER_BYTES, address)) != 0:
            raise RuntimeError(f"KV pool: no Mooncake daemon at {address} (setup_dummy returned {rc})")
        if not (at := self.store.alloc_from_mem_pool(BUFFER_BYTES)):
            raise RuntimeError(f"KV pool: the daemon at {address} gave no {BUFFER_BYTES}-byte buffer")
        self.buffer = np.ctypeslib.as_array((ctypes.c_uint8 * BUFFER_BYTES).from_address(at))
        if (rc := self.store.register_buffer(at, BUFFER_BYTES)) != 0:  # a pool buffer must be registered too
            raise RuntimeError(f"KV pool: register_buffer returned {rc}")
        self.lock = threading.Lock()

    def put(self, name: str, data) -> None:
        data = np.asarray(data).view(np.uint8).reshape(-1)
        if data.nbytes > BUFFER_BYTES:
            raise ValueError(f"a {data.nbytes}-byte block is over the pool buffer's {BUFFER_BYTES} bytes")
        with self.lock:
            self.buffer[:data.nbytes] = data
            (rc,) = self.store.batch_put_from([name], [self.buffer.ctypes.data], [data.nbytes])
        if rc != 0:
            raise RuntimeError(f"Mooncake put of {name} returned {rc}")

    def exists(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        with self.lock:
            codes = self.store.batch_is_exist(names)
        return [c == 1 for c in codes]

    def get(self, names: list[str]) -> list:
        """The blocks of ``names`` in order (all of one size), read a buffer at a time; None from the first one the
        store no longer holds."""
        out: list = []
        with self.lock:
            size = self.store.get_size(names[0]) if names else 0
            if 0 < size <= BUFFER_BYTES:
                per = BUFFER_BYTES // size
                base = self.buffer.ctypes.data
                for start in range(0, len(names), per):
                    chunk = names[start:start + per]
                    got = self.store.batch_get_into(chunk, [base + i * size for i in range(len(chunk))],
                                                    [size] * len(chunk))
                    ok = next((i for i, n in enumerate(got) if n != size), len(chunk))
                    out += [self.buffer[i * size:(i + 1) * size].copy() for i in range(ok)]
                    if ok < len(chunk):
                        break
        return out + [None] * (len(names) - len(out))

    def close(self) -> None:
        self.store.close()
