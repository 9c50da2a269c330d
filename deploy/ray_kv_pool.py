"""The cluster-wide KV pool of a ``pdserve deploy ray`` deployment (``--kv-pool mooncake`` among the worker
arguments): one ``mooncake_master`` and a ``mooncake_client`` daemon on every node that runs a worker, each owned by
a detached actor of the deployment's namespace (``kvpool-master``, ``kvpool-<node id>``) and killed with it
(``deploy ray down`` kills them all).

A worker's actor, before it starts its process, finds its node's daemon (``node_daemon``: made on first use, pinned
to the node, joined to the master, which is made on first use too) and gives the process its address in place of
``mooncake`` (``--kv-pool mooncake://NODE_IP:PORT``). The daemon's share of the pool is the workers'
``--kv-pool-bytes`` (default 4G)."""
from __future__ import annotations

import tempfile

from .units import byte_size

from .kv_pool_servers import start_daemon, start_master

DEFAULT_BYTES = 4 << 30


class PoolServer:
    def describe(self) -> dict:
        """As ``deploy ray status`` lists a deployment's actors."""
        return {"role": "kv-pool", "address": self.at, "node_ip": self.ip, "alive": self.server.proc.poll() is None}


class PoolMaster(PoolServer):
    def __init__(self):
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.server, self.joined = start_master(self.ip, tempfile.mkdtemp(prefix="pdserve-kv-pool-"),
                                                die_with_parent=True)
        self.at = self.joined["master"]

    def address(self) -> dict:
        return self.joined


class PoolDaemon(PoolServer):
    def __init__(self, master: dict, segment_bytes: int):
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.server, self.at = start_daemon(self.ip, master, segment_bytes,
                                            tempfile.mkdtemp(prefix="pdserve-kv-pool-"), die_with_parent=True)

    def address(self) -> str:
        return self.at


def node_daemon(segment_bytes: int) -> str:
    """The address of this node's daemon (from inside an actor of the deployment), made with its master if need be."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    namespace, node = context.namespace, context.get_node_id()
    master = ray.remote(PoolMaster).options(name="kvpool-master", namespace=namespace, lifetime="detached",
                                            get_if_exists=True, num_cpus=0).remote()
    joined = ray.get(master.address.remote(), timeout=120)
    daemon = ray.remote(PoolDaemon).options(
        name=f"kvpool-{node[:16]}", namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(joined, segment_bytes)
    return ray.get(daemon.address.remote(), timeout=120)


def resolve(argv: list[str]) -> list[str]:
    """``argv`` with ``--kv-pool mooncake`` made ``--kv-pool mooncake://<this node's daemon>``."""
    if "--kv-pool" not in argv:
        return argv
    at = argv.index("--kv-pool") + 1
    if at >= len(argv) or argv[at] != "mooncake":
        return argv
    size = argv[argv.index("--kv-pool-bytes") + 1] if "--kv-pool-bytes" in argv else None
    segment = byte_size(size) if size else DEFAULT_BYTES
    return argv[:at] + [f"mooncake://{node_daemon(segment)}"] + argv[at + 1:]
