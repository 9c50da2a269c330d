"""Worker side of the control plane: a zmq ROUTER socket owned by one IO
thread. Incoming messages go to ``handler(identity, msg)`` (keep it quick:
enqueue work). Any thread may ``send``; messages reach the IO thread through
per-thread inproc PUSH sockets, so the socket is only ever touched by its owner.

With a cluster token, a connection must pass the handshake of ``auth``
(``hello`` -> ``challenge`` -> ``auth`` -> ``welcome``) before anything else
is handled; other messages from it are dropped and answered ``auth_required``
(the router then handshakes again, e.g. after this worker restarted)."""
from __future__ import annotations

import collections
import logging
import socket
import threading

import zmq

from . import auth, messages
from .listen import listen, port_of

log = logging.getLogger(__name__)


MAX_PEERS = 1024


class ControlServer:
    """``port``: a number to bind (0: any free port), or a listening socket handed over bound (``control.listen``)."""

    def __init__(self, host: str, port: int | socket.socket, handler, token: bytes | None = None):
        auth.require_token_for(host, token, "worker control port")
        self.ctx = zmq.Context.instance()
        self.handler = handler
        self.token = token
        self._authed: collections.OrderedDict = collections.OrderedDict()
        self._warned: set = set()
        self._pending: collections.OrderedDict = collections.OrderedDict()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        for hwm in (zmq.SNDHWM, zmq.RCVHWM):  # no limit: at 1,000 queued a ROUTER drops a router's tokens silently
            self.sock.setsockopt(hwm, 0)
        listener = port if isinstance(port, socket.socket) else listen(host, port, "--port")
        port = port_of(listener)
        self.sock.setsockopt(zmq.USE_FD, listener.detach())  # zmq accepts on it (and closes it)
        self.sock.bind(f"tcp://{host}:{port}")
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
        if self.token and not self._authenticated(identity, msg):
            return
        try:
            self.handler(identity, msg)
        except Exception:
            log.exception("control handler failed on %s", msg.get("op"))

    def _reply(self, identity, op, **fields):
        try:
            self.sock.send_multipart([identity, messages.encode(op, **fields)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("control reply failed: %s", e)

    def _authenticated(self, identity: bytes, msg: dict) -> bool:
        op = msg["op"]
        if op == "hello" and auth.valid_nonce(msg.get("nonce")):
            ns = auth.nonce()
            self._remember(self._pending, identity, (msg["nonce"], ns))
            self._authed.pop(identity, None)
            self._reply(identity, "challenge", nonce=ns, for_nonce=msg["nonce"],
                        proof=auth.proof(self.token, "server", msg["nonce"], ns))
            return False
        if op == "auth":
            nc, ns = self._pending.pop(identity, (None, None))
            if nc is not None and auth.verify(self.token, "client", ns, nc, msg.get("proof")):
                self._remember(self._authed, identity, True)
                self._reply(identity, "welcome")
            else:
                self.bad_messages += 1
                log.warning("control peer failed the cluster-token handshake")
                self._reply(identity, "auth_required", reason="handshake failed")
            return False
        if identity in self._authed:
            return True
        self.bad_messages += 1
        if identity not in self._warned:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned.add(identity)
            log.warning("dropping %s from an unauthenticated control peer (further drops from it are not logged; "
                        "a router that queued messages while this worker was down sends such)", op)
        self._reply(identity, "auth_required", reason="send hello first")
        return False

    @staticmethod
    def _remember(table: collections.OrderedDict, key, value):
        table[key] = value
        table.move_to_end(key)
        while len(table) > MAX_PEERS:
            table.popitem(last=False)

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.sock.close(0)
        self._pull.close(0)
