"""The servers of the cluster-wide KV pool (``--kv-pool mooncake``) on one machine: ``mooncake_master`` (the index of
every block, with its HTTP metadata server) and this host's ``mooncake_client`` daemon, which holds the host's
segment of the pool (``--kv-pool-bytes``) and which the workers join (``kvcache.stores.mooncake_store``).

Both listen on loopback ports picked free just before they start; one that exits before its ports open (another
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
import time

log = logging.getLogger(__name__)

ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}  # loopback, not the first interface
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


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """One server process, its output in ``log_path``; ready once its ports accept connections."""

    def __init__(self, cmd: list[str], ports: list[int], log_path: str, timeout: float = 60.0):
        self.cmd, self.log_path = cmd, log_path
        with open(log_path, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **ENV})
        deadline = time.monotonic() + timeout
        pending = list(ports)
        while pending:
            if self.proc.poll() is not None:
                raise ServerExited(f"{os.path.basename(cmd[0])} exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", pending[0]), timeout=1):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{os.path.basename(cmd[0])}: port {pending[0]} not open after {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(make, log_path: str, what: str) -> tuple[Server, list[int]]:
    """``make(ports) -> (cmd, ports to wait for)``, started on fresh ports until it stays up."""
    for attempt in range(1, ATTEMPTS + 1):
        ports = free_ports(4)
        cmd, wait = make(ports)
        try:
            return Server(cmd, wait, log_path), ports
        except ServerExited as e:
            log.warning("%s (attempt %d of %d): %s; again on other ports", what, attempt, ATTEMPTS, e)
    raise RuntimeError(f"{what} did not stay up in {ATTEMPTS} attempts (log: {log_path})")


class KVPoolServers:
    """``start()``: the master, then the host's daemon; ``address``: the daemon's, which workers are given
    (``--kv-pool mooncake://ADDRESS``); ``stop()``: both."""

    def __init__(self, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.dir = tempfile.mkdtemp(prefix="pdserve-kv-pool-")
        self.servers: list[Server] = []
        self.address = None

    def start(self) -> "KVPoolServers":
        try:
            master, (rpc, http, metrics, _) = start(lambda p: ([
                binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={p[0]}",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={p[1]}", "--metrics_host=127.0.0.1", f"--metrics_port={p[2]}",
                "--enable_metric_reporting=false"], p[:2]), os.path.join(self.dir, "master.log"), "mooncake_master")
            self.servers.append(master)
            daemon, ports = start(lambda p: ([
                binary("mooncake_client"), "--host=127.0.0.1", f"--port={p[0]}",
                f"--global_segment_size={self.segment_bytes}", f"--local_buffer_size={64 << 20}",
                f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server=http://127.0.0.1:{http}/metadata",
                "--protocol=tcp"], p[:1]), os.path.join(self.dir, "daemon.log"), "mooncake_client")
            self.servers.append(daemon)
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{ports[0]}"
        log.info("KV pool: mooncake_master on 127.0.0.1:%d, this host's daemon on %s (%.1f GiB)", rpc, self.address,
                 self.segment_bytes / 2**30)
        return self

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
