"""Ports a process names for another to bind later (a worker's, a ring rank's).

A port found free by binding port 0 is an OS ephemeral one: before the child
that gets it binds it, another process's outgoing connection may take it.
``free_port`` draws instead from ``PDSERVE_PORT_RANGE`` ("LOW-HIGH", default
20000-32000, below Linux's ephemeral range 32768+), never twice in one
process. Clusters started at once on one host (a test suite on several
workers) each get a range of their own. A process that binds the port
itself should bind port 0 and keep the socket (no race at all)."""
from __future__ import annotations

import os
import random
import socket

HANDED_OUT: set[int] = set()  # ports this process named already (their children may not have bound them yet)


def port_range() -> tuple[int, int]:
    """Where ``free_port`` draws from: ``PDSERVE_PORT_RANGE`` ("LOW-HIGH"), else 20000-32000."""
    low, _, high = os.environ.get("PDSERVE_PORT_RANGE", "20000-32000").partition("-")
    if not (low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65535):
        raise ValueError(f"PDSERVE_PORT_RANGE must be LOW-HIGH within 1024-65535: {low}-{high}")
    return int(low), int(high)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``port_range`` that is free now and that this process never handed out before."""
    low, high = port_range()
    for _ in range(200):
        port = random.randrange(low, high)
        if port in HANDED_OUT:
            continue
        HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
