"""Router and workers as separate processes, so tests can kill, stop, restart
and signal each one (``pdserve up`` would stop them all). As ``pdserve up``
does, the fleet binds each process's listening socket itself and hands it
over (``--control-fd``, ``--listen-fd``): a restarted worker listens on the
same port. A worker run in a network namespace the test made binds a fixed
port there (nothing else runs in that namespace)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from control.lifetime import parent_env
from control.listen import listen, port_of
from deploy.supervise import inherited_fds

NAMESPACE_PORT = 7100  # a worker's control port inside a namespace of its own


class Fleet:
    def __init__(self, *engine_args: str, env: dict | None = None):
        self.engine_args = ["--threads", "1", *engine_args]
        self.env = {**os.environ, **(env or {}), **parent_env()}
        self.sockets: list = []  # the listening sockets handed over, open while the fleet runs
        self.cmds: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.addrs: dict[str, str] = {}
        self.url = ""

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        self.cmds[name] = cmd
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=self.env, pass_fds=inherited_fds(cmd))
        return self.procs[name]

    def worker(self, name: str, role: str, *extra: str, host: str = "127.0.0.1", wrap=None) -> str:
        """``host``: the address it binds; ``wrap``: a function that makes the command run elsewhere (a namespace)."""
        if wrap:
            port, listening = NAMESPACE_PORT + len(self.addrs), []
        else:
            port, listening = self._listen(host)
        cmd = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", role, "--port", str(port), *listening]
        cmd += ["--host", host] + self.engine_args + list(extra)
        self._spawn(name, wrap(cmd) if wrap else cmd)
        self.addrs[name] = f"tcp://{host}:{port}"
        return self.addrs[name]

    def _listen(self, host: str, flag: str = "--control-fd") -> tuple[int, list[str]]:
        sock = listen(host)
        self.sockets.append(sock)
        return port_of(sock), [flag, str(sock.fileno())]

    def router(self, *extra: str, name: str = "router") -> str:
        port, listening = self._listen("127.0.0.1", "--listen-fd")
        cmd = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "router", *listening]
        for wname, addr in self.addrs.items():
            role = next(r for r in ("prefill", "decode") if r in self.cmds[wname])
            cmd += [f"--{'colocated' if '--colocated' in self.cmds[wname] else role}", addr]
        self._spawn(name, cmd + list(extra))
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def pair(self, router=(), prefill=(), decode=()) -> "Fleet":
        """One prefill ``p`` and one decode ``d`` worker behind a router, all healthy."""
        self.worker("p", "prefill", *prefill)
        self.worker("d", "decode", *decode)
        self.router(*router)
        self.wait_healthy()
        return self

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def worker_info(self, name: str) -> dict:
        for workers in self.health()["workers"].values():
            for w in workers:
                if w["address"] == self.addrs[name]:
                    return w
        raise KeyError(name)

    def wait_healthy(self, names=None, timeout: float = 120.0) -> None:
        names = list(names or self.addrs)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if name in names and p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}")
            try:
                if all(self.worker_info(n)["healthy"] for n in names):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{names} not healthy after {timeout:.0f}s")

    def signal(self, name: str, sig=signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait()

    def restart(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.kill()
            p.wait()
        self._spawn(name, self.cmds[name])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in self.procs.values():
            p.wait()
        for sock in self.sockets:
            sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
