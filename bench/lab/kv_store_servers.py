"""The servers ``bench.lab.kv_store`` starts and stops: a local Ray cluster advertising 127.0.0.1 (with the
clients' index actor), and ``mooncake_master`` with its HTTP metadata server and a per-host ``mooncake_client``
daemon on free loopback ports, started as ``pdserve up --kv-pool mooncake`` starts them."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

from deploy.kv_pool_servers import start_daemon, start_master

from .kv_store_clients import INDEX, NAMESPACE, Index

log = logging.getLogger("bench.lab.kv_store")


@contextlib.contextmanager
def ray_cluster(object_store_bytes: int):
    """A local Ray cluster of its own (``address="local"``: not one a stale /tmp/ray file names) and the index actor."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the node advertises 127.0.0.1, not its first interface
    import ray

    temp = tempfile.mkdtemp(prefix="kvlab-ray-")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=object_store_bytes,
                 _temp_dir=temp, logging_level=logging.WARNING, log_to_driver=False)
        index = ray.remote(num_cpus=0)(Index).options(name=INDEX, namespace=NAMESPACE, lifetime="detached").remote()
        ray.get(index.exist.remote([]))
        address = ray.get_runtime_context().gcs_address
        log.info("ray %s: local cluster at %s", ray.__version__, address)
        yield {"ray_address": address, "client_env": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
               "ray_init": f'ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory='
                           f'{object_store_bytes}); clients: ray.init(address="{address}", namespace="{NAMESPACE}")'}
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


# every Mooncake client advertises 127.0.0.1 (not its first interface's address); INFO lines off
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}


@contextlib.contextmanager
def mooncake_master(segment_bytes: int, local_buffer_bytes: int):
    """``mooncake_master`` on free loopback ports with its HTTP metadata server (``deploy.kv_pool_servers``).
    Embedded clients: the writer mounts a segment that holds every block; the reader mounts none, so all it reads
    lives in the writer's."""
    temp = tempfile.mkdtemp(prefix="kvlab-server-")
    server, joined = start_master("127.0.0.1", temp)
    try:
        metadata, master = joined["metadata"], joined["master"]
        yield {"master_cmd": " ".join(server.cmd), "metadata": metadata, "master": master, "client_env": MOONCAKE_ENV,
               "writer_setup": ["127.0.0.1", metadata, segment_bytes, local_buffer_bytes, "tcp", "", master],
               "reader_setup": ["127.0.0.1", metadata, 0, local_buffer_bytes, "tcp", "", master]}
    finally:
        server.stop()
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def mooncake_daemon(segment_bytes: int, pool_bytes: int):
    """The master, and one ``mooncake_client`` for the host that mounts the segment; the workers are its dummy
    clients, each with a shared-memory pool of ``pool_bytes``."""
    with mooncake_master(segment_bytes, 64 << 20) as master:
        temp = tempfile.mkdtemp(prefix="kvlab-server-")
        server, address = start_daemon("127.0.0.1", master, segment_bytes, temp)
        try:
            yield {"master_cmd": master["master_cmd"], "client_cmd": " ".join(server.cmd),
                   "client_env": MOONCAKE_ENV, "dummy_setup": [pool_bytes, 64 << 20, address]}
        finally:
            server.stop()
            shutil.rmtree(temp, ignore_errors=True)
