"""A real ``pdserve up`` cluster as a child process, for tests and benchmarks."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from control.lifetime import parent_env
from deploy.launcher import Launcher

BANNER = re.compile(r"^pdserve is up \(.*\): (http://\S+)$")


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


def descendants_of(pid: int) -> list[int]:
    """Children, their children and so on, as they are now."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Cluster:
    """``pdserve up ARGS --port 0`` in a process session of its own (a signal to the group reaches every worker),
    forked by this process's launcher where there is one (``deploy.launcher``), tied to this process
    (``control.lifetime``: it stops when this process dies, even by SIGKILL). The router's URL is what ``up``
    prints once the cluster is ready."""

    def __init__(self, *args: str, ready_timeout: float = 240.0, threads: int = 1):
        cmd = [sys.executable, "-m", "pdserve", "up", "--port", "0", "--threads", str(threads), *args]
        env = {**os.environ, **parent_env()}
        launcher = Launcher.shared(env)  # a fork of a process that imported torch already (deploy.launcher)
        if launcher is not None:
            self.proc = launcher.start(cmd, env)
        else:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True,
                                         env=env)
        self.ready_timeout = ready_timeout
        self.banner = self.url = ""
        self.lines: queue.Queue = queue.Queue()  # what up prints, line by line ("" once it closed its stdout)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def wait_ready(self) -> "Cluster":
        """Until ``up`` prints its banner (it does once the router's /health is ok, every worker healthy)."""
        end = time.monotonic() + self.ready_timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=min(1.0, max(0.01, end - time.monotonic())))
            except queue.Empty:
                continue
            match = BANNER.match(line.strip())
            if match:
                self.banner, self.url = line, match.group(1)
                return self
            if not line:
                raise RuntimeError(f"pdserve up exited {self.proc.wait()}")
        self.stop()
        raise TimeoutError("cluster did not become healthy")

    def stop(self) -> tuple[list[int], list[int]]:
        """Stop ``up`` with SIGTERM; returns (its descendants: workers, their ranks and helpers, those it left
        running 5 s after it ended)."""
        kids = descendants_of(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        end = time.monotonic() + 5.0
        while any(alive(pid) for pid in kids) and time.monotonic() < end:
            time.sleep(0.05)
        survivors = [pid for pid in kids if alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        return kids, survivors
