"""Workers forked from ``pdserve up`` after it imported torch once, instead of each importing it again.

A worker spends most of its start importing torch (seconds of CPU on a small machine), and ``up`` starts every
worker of its cluster and each one that dies again. On Linux ``up`` imports torch and the worker modules once,
before it starts the first worker: an import only, no CUDA call and no thread, so a fork of ``up`` is as
safe as a fresh process. Each worker is then a fork of ``up`` that does what ``subprocess.Popen`` and
``python -m pdserve ...`` would have done:

- the signal handlers ``up`` set go back to the defaults, stdin is ``/dev/null``, every descriptor but the
  standard three and those its command line names (``--control-fd``) is closed, and its environment replaces
  ``up``'s;
- its title becomes its own command line (``ps`` shows ``... pdserve --log-level L decode ...``, as for an exec'd
  worker, cut to the room ``up``'s own command line and environment had; the router's /health gives each
  worker's pid);
- the root logger's handlers are removed (the worker configures its own), then the same command line runs in
  the process (``runpy``, as ``python -m`` runs it); when it returns, the exit handlers run and the process exits
  with its code, without unwinding into ``up``'s stack.

``up`` gets a ``Forked`` for each: what the supervisor and ``up``'s stop use of ``Popen`` (``poll``, ``wait``,
``send_signal``, ``terminate``, ``kill``, ``pid``, ``returncode``, ``args``). A fork is used only where it can be:
Linux (macOS forbids a fork after its frameworks load), a worker, ``up`` with one Python thread and no CUDA
context; any other child (the router, which never imports torch) starts with exec as before."""
from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn

WORKER_COMMANDS = ("prefill", "decode")
_RESET = {signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_DFL,
          signal.SIGINT: signal.default_int_handler}  # as a fresh interpreter has them (SIGPIPE stays ignored)


def forkable(cmd: list[str]) -> bool:
    """Whether ``cmd`` (``python -m pdserve --log-level L prefill|decode ...``, as ``up`` plans it) may start as a
    fork of this process: Linux, a worker, and after the imports this process still runs one thread and has not
    touched CUDA. An MLX worker on Linux forks too: ``up`` never imports mlx, the worker does."""
    if not sys.platform.startswith("linux") or cmd[3:4] != ["--log-level"] or cmd[5] not in WORKER_COMMANDS:
        return False
    preload()
    import torch

    return _one_thread() and not torch.cuda.is_initialized()


def _one_thread() -> bool:
    """No Python thread but this one. Native threads that imports start (OpenBLAS's pool, with numpy) survive a
    fork, as the many programs that fork after importing torch (its data loaders) rely on; nothing here runs an
    OpenMP region or touches CUDA before the fork."""
    return threading.active_count() == 1


def preload() -> None:
    """Import what every torch worker imports (the slow part of its start); nothing runs on a device."""
    import decode.worker  # noqa: F401
    import prefill.worker  # noqa: F401


class Forked:
    """A forked worker, as ``subprocess.Popen`` would describe it."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(cmd: list[str], env: dict, keep_fds: tuple[int, ...]) -> Forked:
    """``cmd`` as a fork of this process (where ``forkable`` said it may be)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, cmd)
    run_here(cmd, env, keep_fds)


def run_here(cmd: list[str], env: dict, keep_fds: tuple[int, ...]) -> NoReturn:
    """In a freshly forked child: become ``cmd`` (``python -m MODULE ARGS``) and run it; never returns."""
    code = 1
    try:
        _title(cmd)  # first: it moves the process's environment block to take its room
        _become(env, keep_fds)
        sys.argv = [sys.argv[0], *cmd[3:]]
        runpy.run_module(cmd[2], run_name="__main__")  # ``python -m pdserve ...``: it ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        _exit(code)


def _become(env: dict, keep_fds: tuple[int, ...]) -> None:
    for sig, handler in _RESET.items():
        signal.signal(sig, handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    keep = sorted({0, 1, 2, *keep_fds})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    os.environ.clear()
    os.environ.update(env)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


def _title(cmd: list[str]) -> None:
    """``ps``, ``top`` and ``/proc/PID/cmdline`` show the worker's command line, not ``up``'s (as one string:
    ``argv_of`` reads it back as a list)."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # an install without it: the worker shows up's command line
        return
    setproctitle(" ".join(cmd))


def argv_of(pid: int) -> list[str]:
    """A process's command line as a list, also for a forked worker whose title is one string."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    return parts[0].split() if len(parts) == 1 else parts


def _exit(code: int) -> None:
    """What an interpreter does at exit (wait for the non-daemon threads, run the exit handlers), then the process
    ends here, never back into ``up``."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
