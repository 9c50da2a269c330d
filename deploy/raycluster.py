"""Start and stop Ray nodes that pdserve owns (for ``up --transport ray`` and tests).

Ray rewrites ``127.0.0.1``/``localhost`` to the machine's outward address, so
pdserve's nodes use other loopback addresses (127.0.0.2, 127.0.0.3, ...): all
Ray traffic stays on loopback. Token auth is enabled deliberately with a fresh
token per cluster, passed to every process through ``RAY_AUTH_MODE`` and
``RAY_AUTH_TOKEN``. Nodes are stopped by signalling their own process groups,
never with ``ray stop`` (which would stop every Ray on the machine).

``ray start`` must be told its head's port and reports none: the port is one
free a moment before, and a head that exits at start (something took the
port first) is started again on another, with a warning in the log."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import time

DEFAULT_HEAD_IP = "127.0.0.2"
HEAD_TRIES = 3
log = logging.getLogger(__name__)


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, head_ip: str = DEFAULT_HEAD_IP, num_cpus: int = 1, token: str | None = None):
        self.head_ip = head_ip
        self.num_cpus = num_cpus
        self.token = token or secrets.token_hex(16)
        self.port = _free_port(head_ip)
        self.procs: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    @property
    def env(self) -> dict:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": self.address,
                "PDSERVE_RAY_NODE_IP": self.head_ip, "RAY_USAGE_STATS_ENABLED": "0"}

    def _start(self, args: list[str]) -> None:
        env = {**os.environ, **self.env}
        env.pop("RAY_ADDRESS")
        cmd = ["ray", "start", "--block", "--disable-usage-stats", f"--num-cpus={self.num_cpus}", *args]
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           stdin=subprocess.DEVNULL, start_new_session=True))

    def start(self, timeout: float = 60.0) -> "RayCluster":
        for attempt in range(1, HEAD_TRIES + 1):
            self._start(["--head", f"--node-ip-address={self.head_ip}", f"--port={self.port}",
                         "--include-dashboard=false"])
            try:
                self.wait_nodes(1, timeout)
                return self
            except RuntimeError:  # the head exited at start
                self.stop()
                if attempt == HEAD_TRIES:
                    raise
                log.warning("the ray head exited at start on port %d (taken?); starting it on another", self.port)
                self.port = _free_port(self.head_ip)
        return self

    def add_node(self, ip: str, resources: str | None = None, timeout: float = 60.0) -> None:
        args = [f"--address={self.address}", f"--node-ip-address={ip}"]
        if resources:
            args.append(f"--resources={resources}")
        self._start(args)
        self.wait_nodes(len(self.procs), timeout)

    def wait_nodes(self, count: int, timeout: float) -> None:
        env = {**os.environ, **self.env}
        probe = ("import ray, sys; ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], logging_level='ERROR');"
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a ray node exited during startup")
            out = subprocess.run(["python3", "-c", probe, self.address, self.head_ip], env=env,
                                 capture_output=True, text=True, timeout=timeout)
            if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"ray cluster did not reach {count} nodes")

    def stop(self, grace: float = 3.0) -> None:
        for p in reversed(self.procs):
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)
            p.wait()
        self.procs.clear()


def _signal_group(p: subprocess.Popen, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
