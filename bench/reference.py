"""The yardstick: a plain ``sendall`` / ``recv_into`` socket moving the same
bytes between the same two processes, acknowledged with one byte."""
from __future__ import annotations

import socket
import threading
import time


class RawReceiver:
    def __init__(self, nbytes: int, host: str = "127.0.0.1"):
        self.buf = bytearray(nbytes)
        self.server = socket.create_server((host, 0))
        self.address = "%s:%d" % self.server.getsockname()[:2]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            view, n = memoryview(self.buf), len(self.buf)
            with conn:
                while True:
                    got = 0
                    while got < n:
                        r = conn.recv_into(view[got:], n - got)
                        if r == 0:
                            break
                        got += r
                    if got < n:
                        break
                    conn.sendall(b"k")

    def close(self):
        self.server.close()


class RawSender:
    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data) -> float:
        """Seconds from first byte sent to the receiver's acknowledgement."""
        start = time.perf_counter()
        self.sock.sendall(data)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("reference receiver did not acknowledge")
        return time.perf_counter() - start

    def close(self):
        self.sock.close()
