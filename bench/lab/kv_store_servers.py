"""The servers ``bench.lab.kv_store`` starts and stops: a local Ray cluster advertising 127.0.0.1 (with the
clients' index actor), ``mooncake_master`` with its HTTP metadata server on free loopback ports, and a per-host
``mooncake_client`` daemon."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from .kv_store_clients import INDEX, NAMESPACE, Index

log = logging.getLogger("bench.lab.kv_store")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, logfile: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(logfile) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.args[0]}: port {port} not open after {timeout:.0f} s")


@contextlib.contextmanager
def server(cmd: list[str], ports: list[int], env: dict | None = None):
    """A server process, its output in a temporary log, ready once ``ports`` accept; ended on the way out."""
    temp = tempfile.mkdtemp(prefix="kvlab-server-")
    logfile = os.path.join(temp, "server.log")
    with open(logfile, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
    try:
        for port in ports:
            wait_port(port, proc, logfile)
        log.info("%s: pid %d, ports %s", os.path.basename(cmd[0]), proc.pid, ports)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


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


def mooncake_binary(name: str) -> str:
    """The wheel's console script (it execs the binary in the package, so the pid stays the server's)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if found := beside if os.path.exists(beside) else shutil.which(name):
        return found
    raise FileNotFoundError(f"{name} not found: pip install mooncake-transfer-engine-non-cuda")


# every Mooncake process advertises 127.0.0.1 (not its first interface's address); INFO lines off
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}


@contextlib.contextmanager
def mooncake_master(segment_bytes: int, local_buffer_bytes: int):
    """``mooncake_master`` on free loopback ports with its HTTP metadata server. Embedded clients: the writer mounts
    a segment that holds every block; the reader mounts none, so all it reads lives in the writer's."""
    rpc, http, metrics = free_port(), free_port(), free_port()
    cmd = [mooncake_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
           "--enable_metric_reporting=false"]
    with server(cmd, [rpc, http]):
        metadata, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        yield {"master_cmd": " ".join(cmd), "metadata": metadata, "master": master, "client_env": MOONCAKE_ENV,
               "writer_setup": ["127.0.0.1", metadata, segment_bytes, local_buffer_bytes, "tcp", "", master],
               "reader_setup": ["127.0.0.1", metadata, 0, local_buffer_bytes, "tcp", "", master]}


@contextlib.contextmanager
def mooncake_daemon(segment_bytes: int, pool_bytes: int):
    """The master, and one ``mooncake_client`` for the host that mounts the segment; the workers are its dummy
    clients, each with a shared-memory pool of ``pool_bytes``."""
    with mooncake_master(segment_bytes, 64 << 20) as master:
        port = free_port()
        cmd = [mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}",
               f"--global_segment_size={segment_bytes}", f"--local_buffer_size={64 << 20}",
               f"--master_server_address={master['master']}", f"--metadata_server={master['metadata']}",
               "--protocol=tcp"]
        with server(cmd, [port], env=MOONCAKE_ENV):
            yield {"master_cmd": master["master_cmd"], "client_cmd": " ".join(cmd), "client_env": MOONCAKE_ENV,
                   "dummy_setup": [pool_bytes, 64 << 20, f"127.0.0.1:{port}"]}
