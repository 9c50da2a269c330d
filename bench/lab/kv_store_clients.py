"""The clients of ``bench.lab.kv_store``: the same four calls (a buffer, put, exist, get into) on each store it
compares, the Ray object store through a named index actor, Mooncake Store with embedded clients and as dummy
clients of a per-host daemon."""
from __future__ import annotations

import ctypes
import logging
import time

import numpy as np

log = logging.getLogger("bench.lab.kv_store")
NAMESPACE, INDEX = "kvlab", "kvlab-index"


class Index:
    """The Ray store's index, a named detached actor: keys to ``[ObjectRef]`` (the list keeps the ref a ref)."""

    def __init__(self):
        self.refs = {}

    def add(self, refs: dict) -> int:
        self.refs.update(refs)
        return len(self.refs)

    def exist(self, keys: list[int]) -> list[bool]:
        return [k in self.refs for k in keys]

    def lookup(self, keys: list[int]) -> list:
        return [self.refs[k][0] for k in keys]


class RayClient:
    def __init__(self, spec: dict, role: str):
        import ray

        self.ray = ray
        ray.init(address=spec["ray_address"], namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
        self.index = ray.get_actor(INDEX, namespace=NAMESPACE)
        self.copy_s = 0.0

    def buffer(self, shape: tuple[int, int]) -> np.ndarray:
        return np.zeros(shape, dtype=np.uint8)

    def put(self, keys: list[int], blocks: np.ndarray) -> None:
        refs = [self.ray.put(b) for b in blocks]
        self.ray.get(self.index.add.remote({k: [r] for k, r in zip(keys, refs)}))

    def exist(self, keys: list[int]) -> list[bool]:
        return self.ray.get(self.index.exist.remote(keys))

    def get_into(self, keys: list[int], out: np.ndarray) -> None:
        arrays = self.ray.get(self.ray.get(self.index.lookup.remote(keys)), timeout=30)
        start = time.perf_counter()
        for row, array in zip(out, arrays):
            np.copyto(row, array)
        self.copy_s += time.perf_counter() - start

    def clear(self) -> None:
        """Nothing to do: Ray freed the blocks with their owner, the writer."""

    def close(self) -> None:
        self.ray.shutdown()


class MooncakeClient:
    """An embedded client (``setup``): this process's transfer engine serves the segment it mounts."""

    def __init__(self, spec: dict, role: str):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if (rc := self.store.setup(*spec[f"{role}_setup"])) != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup{tuple(spec[f'{role}_setup'])} returned {rc}")
        self.copy_s = 0.0

    def buffer(self, shape: tuple[int, int]) -> np.ndarray:
        return self.register(np.zeros(shape, dtype=np.uint8))

    def register(self, buf: np.ndarray) -> np.ndarray:
        if (rc := self.store.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
            raise RuntimeError(f"register_buffer({buf.nbytes} bytes) returned {rc}")
        return buf

    def put(self, keys: list[int], blocks: np.ndarray) -> None:
        rcs = self.store.batch_put_from([str(k) for k in keys], [b.ctypes.data for b in blocks],
                                        [b.nbytes for b in blocks])
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_put_from: codes {sorted(set(rcs))}")

    def exist(self, keys: list[int]) -> list[bool]:
        codes = self.store.batch_is_exist([str(k) for k in keys])
        if any(c < 0 for c in codes):
            raise RuntimeError(f"batch_is_exist: codes {sorted(set(codes))}")
        return [c == 1 for c in codes]

    def get_into(self, keys: list[int], out: np.ndarray) -> None:
        sizes = self.store.batch_get_into([str(k) for k in keys], [r.ctypes.data for r in out], [r.nbytes for r in out])
        if any(s != r.nbytes for s, r in zip(sizes, out)):
            raise RuntimeError(f"batch_get_into: sizes or codes {sorted(set(sizes))}, wanted {out[0].nbytes}")

    def clear(self) -> None:
        """Removes every block (leases ignored), so the next run finds a segment as empty as this one did."""
        self.store.remove_all(True)

    def close(self) -> None:
        self.store.close()


class MooncakeDaemonClient(MooncakeClient):
    """A dummy client (``setup_dummy``) of the host's ``mooncake_client`` process, which mounts the segment: blocks
    go in and out through a shared-memory pool, and outlive the worker that wrote them."""

    def __init__(self, spec: dict, role: str):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if (rc := self.store.setup_dummy(*spec["dummy_setup"])) != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup_dummy{tuple(spec['dummy_setup'])} returned {rc}")
        self.copy_s = 0.0

    def buffer(self, shape: tuple[int, int]) -> np.ndarray:
        nbytes = shape[0] * shape[1]
        if not (address := self.store.alloc_from_mem_pool(nbytes)):
            raise RuntimeError(f"alloc_from_mem_pool({nbytes}) failed")
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)).reshape(shape)
        buf[:] = 0
        return self.register(buf)  # allocated in the pool is not enough: puts from it fail (-600) unregistered


CLIENTS = {"ray": RayClient, "mooncake": MooncakeClient, "mooncake-daemon": MooncakeDaemonClient}
