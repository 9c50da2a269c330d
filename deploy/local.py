"""A real ``pdserve up`` cluster as a child process, for tests and benchmarks."""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from control.ports import free_port, port_range  # noqa: F401 (tests take free_port from here)

SLICE = 50  # ports a cluster draws from: its router's and its workers'
_slices = itertools.count()


def own_ports() -> tuple[int, int]:
    """``(router port, end)``: a slice of this process's port range no other cluster it started recently draws from
    (clusters started at once each pick their workers' ports in their own slice: two ``pdserve up`` picking ports
    from one range at the same moment could take the same one before either bound it). The first port of the slice,
    free now, is the router's."""
    low, high = port_range()
    count = max(1, (high - low) // SLICE)
    for _ in range(count):
        first = low + (next(_slices) % count) * SLICE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", first))
            except OSError:
                continue
        return first, first + SLICE
    return free_port(), 0


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Cluster:
    def __init__(self, *args: str, ready_timeout: float = 240.0, threads: int = 1):
        self.port, end = own_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(self.port), "--threads", str(threads), *args]
        env = {**os.environ, **({"PDSERVE_PORT_RANGE": f"{self.port + 1}-{end}"} if end else {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True,
                                     env=env)
        self.ready_timeout = ready_timeout
        self.banner = ""

    def wait_ready(self) -> "Cluster":
        end = time.monotonic() + self.ready_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.banner = self.proc.stdout.readline()
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError("cluster did not become healthy")

    def stop(self) -> tuple[list[int], list[int]]:
        """Stop ``up`` with SIGTERM; returns (its children, those it left running)."""
        kids = children_of(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        time.sleep(0.2)
        survivors = [pid for pid in kids if alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        return kids, survivors
