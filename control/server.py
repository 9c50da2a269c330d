"""Worker side of the control plane: a zmq ROUTER socket owned by one IO
thread. Incoming messages go to ``handler(identity, msg)`` (keep it quick:
enqueue work). Any thread may ``send``; messages reach the IO thread through
per-thread inproc PUSH sockets, so the socket is only ever touched by its owner."""
from __future__ import annotations

import logging
import threading

import zmq

from . import messages

log = logging.getLogger(__name__)


class ControlServer:
    def __init__(self, host: str, port: int, handler):
        self.ctx = zmq.Context.instance()
        self.handler = handler
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._inproc = f"inproc://ctl-out-{id(self)}"
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._local = threading.local()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="control-io", daemon=True)
        self.bad_messages = 0

    def start(self):
        self._thread.start()

    def send(self, identity: bytes, op: str, **fields) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self._inproc)
        push.send_multipart([identity, messages.encode(op, **fields)])

    def _loop(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(200))
            if self._pull in ready:
                while True:
                    try:
                        self.sock.send_multipart(self._pull.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    except zmq.ZMQError as e:
                        log.warning("control send failed: %s", e)
            if self.sock in ready:
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frames)

    def _dispatch(self, frames):
        if len(frames) != 2:
            self.bad_messages += 1
            log.warning("dropping control message with %d frames", len(frames))
            return
        identity, raw = frames
        try:
            msg = messages.decode(raw)
        except messages.MessageError as e:
            self.bad_messages += 1
            log.warning("dropping control message: %s", e)
            return
        try:
            self.handler(identity, msg)
        except Exception:
            log.exception("control handler failed on %s", msg.get("op"))

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)
        self._pull.close(0)
