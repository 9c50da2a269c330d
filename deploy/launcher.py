"""A process that starts ``pdserve up`` by fork, for harnesses that start many clusters (tests, benchmarks).

``pdserve up`` imports torch before its first worker (``deploy.forked``): seconds of CPU each time a harness
starts a cluster. A harness instead asks one launcher, started the first time it needs one, which imported the
workers' modules (``forked.preload``) and forks each ``up`` it is asked for. Protocol, over a Unix
``SOCK_SEQPACKET`` pair (a message is one JSON packet):

- harness -> launcher: ``{"argv": [...], "env": {...}}`` with one descriptor beside it, the write end of the
  pipe the ``up`` writes its stdout to. The launcher forks; the child starts a session of its own (a signal to
  its group reaches every worker), takes the descriptor as its stdout, and runs the command in the process
  (``forked.run_here``) with the launcher as the parent it follows (``control.lifetime``). The launcher answers
  ``{"pid": N}``.
- launcher -> harness: ``{"exited": N, "code": C}`` when a child it forked ended (it reaps them; C as
  ``Popen.returncode`` gives it).

The launcher exits when the harness closes its end (the harness ended, even by SIGKILL), and every ``up`` it
started then gets SIGTERM (``control.lifetime``), so nothing outlives the harness. ``Launched`` is what
``deploy.local.Cluster`` uses of ``Popen``."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from control.lifetime import PARENT_ENV
from deploy import forked

FD_ENV = "PDSERVE_LAUNCHER_FD"
MAX_MESSAGE = 1 << 20


class Launched:
    """An ``up`` the launcher forked, as ``subprocess.Popen`` describes it (``stdout``: its output, text)."""

    def __init__(self, launcher: "Launcher", pid: int, args: list[str], stdout):
        self.launcher, self.pid, self.args, self.stdout = launcher, pid, args, stdout

    @property
    def returncode(self) -> int | None:
        return self.launcher.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        with self.launcher.ended:
            while self.returncode is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.launcher.ended.wait(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The harness's end: one launcher process for this process, started on first use (``shared``)."""

    _shared: "Launcher | None" = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls, env: dict) -> "Launcher | None":
        """This process's launcher for a child of environment ``env``. None off Linux, and for an environment other
        than the one the launcher imported under (a module may read a variable at import): ``Cluster`` then starts
        ``up`` with exec."""
        if not sys.platform.startswith("linux"):
            return None
        with cls._lock:
            if cls._shared is None or cls._shared.proc.poll() is not None:
                cls._shared = cls(env)
            return cls._shared if cls._shared.key == _key(env) else None

    def __init__(self, env: dict):
        self.key = _key(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", "from deploy.launcher import serve; serve()"],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     env={**env, FD_ENV: str(theirs.fileno())})
        theirs.close()
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.pids: list[int] = []
        self.started = threading.Condition()
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, name="launcher-read", daemon=True).start()

    def start(self, argv: list[str], env: dict) -> Launched:
        read, write = os.pipe()
        try:
            with self.send_lock, self.started:
                socket.send_fds(self.sock, [json.dumps({"argv": argv, "env": env}).encode()], [write])
                while not self.pids:
                    if not self.started.wait(60):
                        raise RuntimeError("the launcher did not answer")
                pid = self.pids.pop(0)
        finally:
            os.close(write)
        return Launched(self, pid, argv, os.fdopen(read, "r"))

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                return
            msg = json.loads(data)
            if "pid" in msg:
                with self.started:
                    self.pids.append(msg["pid"])
                    self.started.notify_all()
            else:
                with self.ended:
                    self.codes[msg["exited"]] = msg["code"]
                    self.ended.notify_all()


def _key(env: dict) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k != PARENT_ENV)


def serve() -> None:
    """The launcher's loop: fork what the harness asks for, report what ends, exit when the harness is gone."""
    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))  # (no longer in the environment children get)
    forked.preload()
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.1)
        _reap(sock, children)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            data = b""
        if not data:
            return  # the harness ended: our children follow us (control.lifetime)
        msg = json.loads(data)
        pid = _fork(msg["argv"], msg["env"], fds[0], sock)
        os.close(fds[0])
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())


def _fork(argv: list[str], env: dict, stdout: int, sock: socket.socket) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    sock.close()
    os.setsid()
    os.dup2(stdout, 1)
    forked.run_here(argv, {**env, PARENT_ENV: str(os.getppid())}, ())


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
