"""Processes that do not outlive the process that started them.

``pdserve up`` runs its router and workers as children; a test harness or a
benchmark runs ``pdserve up`` in a process session of its own (so that a
signal to its group reaches the whole cluster). If the starter dies, even by
SIGKILL, its children must go too, or they hold memory and ports for the next
run. The starter puts its pid in the child's environment (``parent_env``);
the child, first thing (``follow_parent``), asks the kernel for SIGTERM when
that parent dies (Linux: ``PR_SET_PDEATHSIG``) and exits at once if it is
already gone. SIGTERM is a graceful stop for every pdserve process: ``up``
stops its workers, a worker finishes what it can. The variable is removed
on reading, so the child's own children are not tied to the wrong parent.

The kernel's tie is to the starting *thread*: ``parent_env`` ties only a
child started from the main thread (one started from a worker thread that
then ends would be stopped with it)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PARENT_ENV = "PDSERVE_PARENT_PID"
PR_SET_PDEATHSIG = 1


def parent_env() -> dict:
    """Environment entries that tie a child started now to this process (none from a thread but the main one)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {PARENT_ENV: str(os.getpid())}


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """This process gets ``sig`` when the thread that started it ends (Linux; elsewhere nothing). Also a
    ``preexec_fn`` for a child that must not outlive its starter. Returns whether the tie was made."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(PR_SET_PDEATHSIG, sig) == 0


def follow_parent() -> bool:
    """In a child started with ``parent_env``: SIGTERM when the parent dies. Returns whether the tie was made."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit() or not die_with_parent(signal.SIGTERM):
        return False
    if os.getppid() != int(expected):  # the parent died before the tie was made
        os.kill(os.getpid(), signal.SIGTERM)
    return True
