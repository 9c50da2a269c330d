"""What every worker process shares: a control server, an inbox drained by one
engine thread, ping/pong with the worker's description, and reply routing by
request id back to the router connection that asked."""
from __future__ import annotations

import logging
import queue
import signal
import threading

from .server import ControlServer

log = logging.getLogger(__name__)


class WorkerLoop:
    role = "worker"

    def __init__(self, host: str, port: int):
        self.inbox: queue.Queue = queue.Queue()
        self.server = ControlServer(host, port, self._on_message)
        self.reply_to: dict[str, bytes] = {}
        self.stopping = threading.Event()

    def info(self) -> dict:
        return {"role": self.role}

    def _on_message(self, identity: bytes, msg: dict) -> None:
        if msg["op"] == "ping":
            self.server.send(identity, "pong", info=self.info(), t=msg.get("t"))
            return
        rid = msg.get("rid")
        if not rid:
            log.warning("dropping %s message without rid", msg["op"])
            return
        if msg["op"] != "abort":
            self.reply_to[rid] = identity
        self.inbox.put(msg)

    def emit(self, rid: str, op: str, **fields) -> None:
        identity = self.reply_to.get(rid)
        if identity is None:
            return
        self.server.send(identity, op, rid=rid, **fields)
        if op in ("done", "error"):
            self.reply_to.pop(rid, None)

    def fail(self, rid: str, status: int, message: str) -> None:
        self.emit(rid, "error", status=status, message=message)

    def handle(self, msg: dict) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        return False

    def tick(self) -> None:
        pass

    def serve_forever(self) -> None:
        self.server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        log.info("%s worker ready on %s", self.role, self.server.address)
        while not self.stopping.is_set():
            try:
                msg = self.inbox.get(timeout=0 if self.busy() else 0.05)
                while True:
                    self._safe_handle(msg)
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                pass
            self.tick()
        self.close()

    def _safe_handle(self, msg):
        try:
            self.handle(msg)
        except Exception as e:
            log.exception("failed to handle %s for %s", msg.get("op"), msg.get("rid"))
            self.fail(msg.get("rid"), 500, f"internal error: {e}")

    def close(self) -> None:
        self.server.close()
