"""The servers of the cluster-wide KV pool (``--kv-pool mooncake``): ``mooncake_master`` (the index of every block,
with its HTTP metadata server; one a cluster) and a ``mooncake_client`` daemon on each host, which holds the host's
segment of the pool (``--kv-pool-bytes``) and which the host's workers join (``kvcache.stores.mooncake_store``).
``KVPoolServers`` starts both on loopback for ``pdserve up``; ``deploy.ray_kv_pool`` starts them on a Ray
cluster's nodes.

Each listens on ports of its host picked free just before it starts; one that exits before its ports open (another
process took a port in between) is started again on new ports, a few times."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from control import lifetime

log = logging.getLogger(__name__)

ATTEMPTS = 5


class ServerExited(RuntimeError):
    pass


def binary(name: str) -> str:
    """The Mooncake wheel's console script (beside this Python, else on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if found := beside if os.path.exists(beside) else shutil.which(name):
        return found
    raise RuntimeError(f"{name} not found: --kv-pool mooncake needs pip install mooncake-transfer-engine-non-cuda "
                            "(and libibverbs1)")


def free_ports(n: int, host: str) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """One server process on ``host``, its output in ``log_path``; ready once its ports accept connections.
    ``die_with_parent``: started by a thread of its own that lives as long as it does, and killed when that thread's
    process goes (a Ray actor's server)."""

    def __init__(self, cmd: list[str], host: str, ports: list[int], log_path: str, die_with_parent: bool = False,
                 timeout: float = 60.0):
        self.cmd, self.log_path = cmd, log_path
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": host, "MC_LOG_LEVEL": "WARNING"}  # this host, not its first NIC
        started = threading.Event()
        threading.Thread(target=self._run, args=(cmd, env, die_with_parent, started), daemon=True).start()
        started.wait()
        deadline = time.monotonic() + timeout
        pending = list(ports)
        while pending:
            if self.proc.poll() is not None:
                raise ServerExited(f"{os.path.basename(cmd[0])} exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((host, pending[0]), timeout=1):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{os.path.basename(cmd[0])}: port {pending[0]} not open after {timeout:.0f} s")
            time.sleep(0.1)

    def _run(self, cmd, env, die_with_parent, started):
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=not die_with_parent,
                                         preexec_fn=lifetime.die_with_parent if die_with_parent else None)
        started.set()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(make, host: str, log_path: str, what: str, die_with_parent: bool = False) -> tuple[Server, list[int]]:
    """``make(ports) -> (cmd, ports to wait for)``, started on fresh ports of ``host`` until it stays up."""
    for attempt in range(1, ATTEMPTS + 1):
        ports = free_ports(4, host)
        cmd, wait = make(ports)
        try:
            return Server(cmd, host, wait, log_path, die_with_parent), ports
        except ServerExited as e:
            log.warning("%s (attempt %d of %d): %s; again on other ports", what, attempt, ATTEMPTS, e)
    raise RuntimeError(f"{what} did not stay up in {ATTEMPTS} attempts (log: {log_path})")


def start_master(host: str, log_dir: str, die_with_parent: bool = False) -> tuple[Server, dict]:
    """``mooncake_master`` on ``host``; what a daemon needs to join it (``master``, ``metadata``)."""
    server, (rpc, http, metrics, _) = start(lambda p: ([
        binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={p[0]}",
        "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={p[1]}", f"--metrics_host={host}", f"--metrics_port={p[2]}",
        "--enable_metric_reporting=false"], p[:2]), host, os.path.join(log_dir, "master.log"), "mooncake_master",
        die_with_parent)
    return server, {"master": f"{host}:{rpc}", "metadata": f"http://{host}:{http}/metadata"}


def start_daemon(host: str, master: dict, segment_bytes: int, log_dir: str,
                 die_with_parent: bool = False) -> tuple[Server, str]:
    """This host's ``mooncake_client`` daemon, holding ``segment_bytes`` of the pool; its address."""
    server, ports = start(lambda p: ([
        binary("mooncake_client"), f"--host={host}", f"--port={p[0]}", f"--global_segment_size={segment_bytes}",
        f"--local_buffer_size={64 << 20}", f"--master_server_address={master['master']}",
        f"--metadata_server={master['metadata']}", "--protocol=tcp"], p[:1]), host,
        os.path.join(log_dir, "daemon.log"), "mooncake_client", die_with_parent)
    return server, f"{host}:{ports[0]}"


class KVPoolServers:
    """``start()``: the master, then this host's daemon, on loopback; ``address``: the daemon's, which workers are
    given (``--kv-pool mooncake://ADDRESS``); ``stop()``: both."""

    def __init__(self, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.dir = tempfile.mkdtemp(prefix="pdserve-kv-pool-")
        self.servers: list[Server] = []
        self.address = None

    def start(self) -> "KVPoolServers":
        try:
            master, joined = start_master("127.0.0.1", self.dir)
            self.servers.append(master)
            daemon, self.address = start_daemon("127.0.0.1", joined, self.segment_bytes, self.dir)
            self.servers.append(daemon)
        except BaseException:
            self.stop()
            raise
        log.info("KV pool: mooncake_master on %s, this host's daemon on %s (%.1f GiB)", joined["master"],
                 self.address, self.segment_bytes / 2**30)
        return self

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
