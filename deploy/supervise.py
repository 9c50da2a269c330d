"""Supervision of ``pdserve up``'s worker processes.

A worker that exits while the cluster is not stopping is started again with
the same command line and the same inherited listening socket (the port
``up`` bound for it, so the router reconnects by itself),
after an exponential backoff (``backoff_s`` doubling up to ``max_backoff_s``;
a worker that stayed up ``stable_s`` starts again from the shortest delay).
After ``max_restarts`` restarts it stays down and the cluster serves with the
rest. Each restart is logged and handed to the child as ``PDSERVE_RESTARTS``,
which the worker reports in its heartbeat: the router shows it in ``/health``
and as ``pdserve_worker_restarts``."""
from __future__ import annotations

import logging
import subprocess
import time

from deploy import forked

log = logging.getLogger("pdserve.up")

RESTARTS_ENV = "PDSERVE_RESTARTS"
FD_FLAGS = ("--control-fd", "--listen-fd")  # descriptors a child inherits (control.listen)


def inherited_fds(cmd: list[str]) -> tuple[int, ...]:
    """The descriptors a command line names with ``FD_FLAGS``: open in the child under the same numbers."""
    return tuple(int(cmd[i + 1]) for i, arg in enumerate(cmd[:-1]) if arg in FD_FLAGS)


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict, restartable: bool = True):
        self.name = name
        self.cmd = cmd
        self.env = env
        self.restartable = restartable
        self.restarts = 0
        self.failures = 0
        self.proc: subprocess.Popen | forked.Forked | None = None
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.given_up = False

    def start(self) -> None:
        """A fork of ``up`` where it can be (``deploy.forked``: torch imported once), else a fresh process."""
        env = {**self.env, RESTARTS_ENV: str(self.restarts)}
        if forked.forkable(self.cmd):
            self.proc = forked.start(self.cmd, env, inherited_fds(self.cmd))
        else:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, env=env, pass_fds=inherited_fds(self.cmd))
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, max_restarts: int = 10, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 stable_s: float = 60.0):
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.children: list[Child] = []

    def add(self, child: Child) -> Child:
        self.children.append(child)
        child.start()
        return child

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children if c.proc is not None]

    def check(self) -> Child | None:
        """Restart what is due; returns a child that died and may not be restarted (the cluster must stop)."""
        now = time.monotonic()
        for child in self.children:
            if child.running or child.given_up:
                continue
            if child.restart_at is None:
                code = child.proc.returncode if child.proc else None
                if not child.restartable:
                    return child
                if now - child.started_at >= self.stable_s:
                    child.failures = 0
                if child.restarts >= self.max_restarts:
                    child.given_up = True
                    log.error("%s exited (code %s) after %d restarts; leaving it down", child.name, code, child.restarts)
                    continue
                delay = min(self.max_backoff_s, self.backoff_s * (2 ** child.failures))
                child.failures += 1
                child.restart_at = now + delay
                log.warning("%s exited (code %s); restarting in %.1fs (restart %d of at most %d)", child.name, code,
                            delay, child.restarts + 1, self.max_restarts)
            elif now >= child.restart_at:
                child.restarts += 1
                child.start()
                log.warning("%s restarted (pid %d, restart %d)", child.name, child.proc.pid, child.restarts)
        return None
