"""Listening sockets a process binds itself, or inherits already bound.

No pdserve process names a port for another process to bind later: a port
found free and released can be taken by anything on the machine (an outgoing
connection, another cluster) before the other process binds it. Instead:

- a process binds its own port (0: the OS picks one) and reports what it got:
  a decode worker's KV port in its pongs, a TP group's rendezvous store to its
  followers, a pipeline's stages to stage 0;
- ``pdserve up`` binds its router's port and each worker's control port itself
  and hands the listening socket to the child as an inherited descriptor
  (``--listen-fd``, ``--control-fd``). The port stays bound while a worker
  restarts, so the router reconnects to the same address;
- a program that must be told its port before it starts and binds it with
  SO_REUSEPORT (MLX's ring backend) gets a port that whoever writes its
  hostfile keeps bound meanwhile (``reserve``): no other process can bind it,
  and the kernel never gives it to an outgoing connection.

A port the user named that another process holds raises ``PortInUse``; the
command line prints its one line and exits 2."""
from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    def __init__(self, host: str, port: int, flag: str = "--port"):
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} is in use ({flag}); name another, or 0 for any "
                                           "free port")
        self.host, self.port, self.flag = host, port, flag

    def __str__(self) -> str:
        return self.strerror


def listen(host: str, port: int = 0, flag: str = "--port", backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: a port the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as e:
        if e.errno == errno.EADDRINUSE and port:
            raise PortInUse(host, port, flag) from None
        raise


def inherited(fd: int) -> socket.socket:
    """The listening socket behind descriptor ``fd``, handed over by the process that started this one."""
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
        raise ValueError(f"descriptor {fd} is not a listening TCP socket")
    return sock


def handed_over(fd: int | None, port: int) -> socket.socket | int:
    """A worker's control port: the socket inherited as ``fd`` (which must listen on ``port`` when one is named),
    else ``port``, for the worker to bind."""
    if fd is None:
        return port
    sock = inherited(fd)
    if port and port_of(sock) != port:
        raise SystemExit(f"pdserve: --control-fd {fd} listens on port {port_of(sock)}, not --port {port}")
    return sock


def reserve(host: str = "127.0.0.1") -> socket.socket:
    """A port held bound (SO_REUSEPORT, not listening) for a program that binds it itself with SO_REUSEPORT; keep
    the socket open until that program has bound it (closing it earlier frees the port for anyone)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]
