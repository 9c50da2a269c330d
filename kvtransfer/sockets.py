"""Shared machinery of socket-based transports (tcp, pickle, shm).

Sender: persistent connections per peer (``ConnectionPool``); a transfer is
BEGIN, a transport-specific body, END (sender timings), then the receiver's
ACK. Receiver: an accept loop, one thread per connection reading transfers
back to back; any framing or limit violation drops that connection (with a
NACK when possible) and fails the transfer in progress, never the process.

Limits on the receiver: with a cluster token every connection must pass the
handshake first (within ``timeout_s``); a connection idle between transfers
longer than ``idle_s`` is closed (the sender reconnects); a transfer, once its
first byte arrived, must keep moving (``timeout_s`` per read); at most
``MAX_CONNECTIONS`` connections are served at once."""
from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time

from control.auth import require_token_for
from control.listen import listen

from . import frames
from .base import KVReceiver, KVSender, ReceivedKV, TransferError, TransportConfig
from .handshake import client_handshake, server_handshake
from .layout import KVLayout, LayoutError
from .phases import PhaseTimes
from .pool import BufferPool, PoolExhausted
from .state import TransferTable

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
IDLE_S = 300.0


def parse_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


class SocketSender(KVSender):
    owned = None  # the Arena this sender's ``alloc`` hands out, if any

    def __init__(self, cfg: TransportConfig | None = None):
        self.cfg = cfg or TransportConfig()
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._sending: dict[str, socket.socket] = {}
        self._lock = threading.Lock()

    def _checkout(self, dest: str) -> tuple[socket.socket, float | None]:
        """A connection to ``dest`` and how long it sat idle (None: new)."""
        with self._lock:
            pool = self._idle.setdefault(dest, [])
            while pool:
                sock, since = pool.pop()
                if not select.select([sock], [], [], 0)[0]:
                    return sock, time.monotonic() - since
                sock.close()
        sock = socket.create_connection(parse_address(dest), timeout=self.cfg.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.cfg.token:
                client_handshake(sock, self.cfg.token)
        except BaseException:
            sock.close()
            raise
        return sock, None

    def send(self, dest, transfer_id, layout: KVLayout, layers, meta=None) -> PhaseTimes:
        phases = PhaseTimes(bytes=layout.total_nbytes)
        sock, ok, t0 = None, False, time.perf_counter()
        try:
            sock, idle_for = self._checkout(dest)
            self._sending[transfer_id] = sock
            payload = self._prepare(layout, layers, phases)
            with self._ordered():
                extra = self._begin_fields(dest, idle_for, layout, payload)
                begin = {"tid": transfer_id, "layout": layout.to_dict(), "meta": meta or {}, **extra}
                sock.sendall(frames.meta_frame(frames.BEGIN, begin))
                setup = (time.perf_counter() - t0) * 1e3 - phases.d2h - phases.serialize
                overlap = self._send_body(sock, layout, payload, phases)
                sender = {"d2h": phases.d2h, "serialize": phases.serialize, "wire": phases.wire,
                          "overlap": overlap * 1e3, "setup": setup}
                with phases.measure("wire"):
                    sock.sendall(frames.meta_frame(frames.END, sender))
                    status, length = frames.read_prefix(sock, frames.ACK)
                    reply = frames.read_meta(sock, length)
            if status != 0:
                raise TransferError(f"receiver refused transfer {transfer_id}: {reply.get('error')}")
            ok = True
            return phases
        except (OSError, ValueError, TransferError) as e:
            raise TransferError(f"transfer {transfer_id} to {dest} failed: {e}") from e
        finally:
            self._sending.pop(transfer_id, None)
            if ok:
                with self._lock:
                    self._idle.setdefault(dest, []).append((sock, time.monotonic()))
            elif sock is not None:
                sock.close()

    def cancel(self, transfer_id: str) -> None:
        shut_down(self._sending.get(transfer_id))

    def _prepare(self, layout, layers, phases):
        """Work done before the first byte goes out (a non-streaming transport serializes here).
        A KV that fills one region of ``owned`` (what ``alloc`` handed out) becomes that region's
        byte ``slice``, so the body can send it from there at once."""
        if self.owned is None:
            return layers
        with phases.measure("serialize"):
            start = self.owned.region_of(layout, layers)
        return layers if start is None else slice(start, start + layout.total_nbytes)

    def _ordered(self):
        """Held from BEGIN to the receiver's ACK (a transport whose data plane must see
        transfers in one order on both ends returns a lock: the receiver then sees them one at a time)."""
        return contextlib.nullcontext()

    def _begin_fields(self, dest, idle_for, layout, payload) -> dict:
        """Transport-specific fields of the BEGIN header (``idle_for``: see ``_checkout``)."""
        return {}

    def _send_body(self, sock, layout, payload, phases) -> float:
        """Send the payload; returns the seconds of the sender's own non-wire work after
        BEGIN (d2h, serialize, waiting for ``layers``), which the receiver takes out of its
        elapsed time to leave the wire time."""
        raise NotImplementedError

    def close(self):
        with self._lock:
            for pool in self._idle.values():
                for sock, _ in pool:
                    sock.close()
            self._idle.clear()


def peer_hung_up(sock, wait_s: float = 0.0) -> bool:
    """Whether the other end closed ``sock`` (looks at most ``wait_s``; pending data is not a hang-up)."""
    if not select.select([sock], [], [], wait_s)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def read_grant(sock, required: dict) -> dict:
    """The receiver's GRANT (``required`` maps each key to its type), or its refusal as TransferError."""
    kind, _, length = frames.parse_prefix(frames.recv_exact(sock, frames.PREFIX.size))
    grant = frames.read_meta(sock, length)
    if kind == frames.ACK:
        raise TransferError(f"receiver refused: {grant.get('error')}")
    if kind != frames.GRANT or any(not isinstance(grant.get(k), t) for k, t in required.items()):
        raise frames.FrameError(f"expected a GRANT with {sorted(required)}, got frame kind {kind}")
    return grant


def timed_layers(layers, expected: int):
    """Iterate ``layers`` and count the time spent waiting for each; yields (index, pair)."""
    waited, count, source = [0.0], 0, iter(layers)
    while True:
        t0 = time.perf_counter()
        pair = next(source, None)
        waited[0] += time.perf_counter() - t0
        if pair is None:
            break
        if count >= expected:
            raise ValueError(f"more layers than the layout's {expected}")
        yield count, pair, waited
        count += 1
    if count != expected:
        raise ValueError(f"got {count} layers, layout declares {expected}")


class TableReceiver(KVReceiver):
    """Receiver state kept in a ``TransferTable``: poll, wait, abort and completion callbacks."""

    def __init__(self, cfg: TransportConfig | None = None):
        self.cfg = cfg or TransportConfig()
        self.table = TransferTable(self.cfg.lease_s, on_change=self._changed)

    def _changed(self, tid, status):
        if self.on_complete:
            self.on_complete(tid, status)

    def poll(self, transfer_id):
        return self.table.status(transfer_id)

    def wait(self, transfer_id, timeout=None) -> ReceivedKV:
        return self.table.wait(transfer_id, self.cfg.timeout_s if timeout is None else timeout)

    def abort(self, transfer_id):
        self.table.abort(transfer_id)


def shut_down(sock: socket.socket | None) -> None:
    """Wake whoever is blocked on ``sock`` (its call fails at once); the owner closes it."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class SocketReceiver(TableReceiver):
    def __init__(self, cfg: TransportConfig | None = None, pool: BufferPool | None = None):
        super().__init__(cfg)
        self.pool = pool or BufferPool(self.cfg.pool_bytes)
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._receiving: dict[str, socket.socket] = {}
        self._closing = False
        self.dropped_connections = 0

    @property
    def address(self) -> str:
        try:
            host, port = self._server.getsockname()[:2]
        except OSError:  # closed: a draining worker still answers pings
            return getattr(self, "_address", "")
        self._address = f"{host}:{port}"
        return self._address

    def start(self) -> None:
        require_token_for(self.cfg.host, self.cfg.token, f"{self.name} KV receiver")
        self._server = listen(self.cfg.host, self.cfg.port, "--kv-port")
        self._server.settimeout(1.0)
        threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True).start()

    def _accept_loop(self):
        while not self._closing:
            try:
                sock, peer = self._server.accept()
            except socket.timeout:
                self.table.expire()
                continue
            except OSError:
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                self.dropped_connections += 1
                log.warning("refusing %s connection from %s: %d already open", self.name, peer, len(self._conns))
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer), name=f"{self.name}-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer):
        current: list = [None]
        idle_s = float(self.cfg.options.get("idle_s", IDLE_S))
        try:
            if self.cfg.token:
                sock.settimeout(self.cfg.timeout_s)
                server_handshake(sock, self.cfg.token)
            while not self._closing:
                sock.settimeout(idle_s)
                current[0] = None
                if not sock.recv(1, socket.MSG_PEEK):
                    return
                sock.settimeout(self.cfg.timeout_s)
                self._receive_one(sock, current)
        except (frames.FrameError, LayoutError, PoolExhausted, ValueError, TransferError) as e:
            self.dropped_connections += 1
            log.warning("dropping %s connection from %s: %s", self.name, peer, e)
            self._nack(sock, current[0], str(e))
            if current[0] is not None:
                self.table.fail(current[0], str(e))
        except OSError as e:
            if current[0] is not None:
                self.table.fail(current[0], f"connection lost: {e}")
            elif not self._closing:
                log.debug("%s connection from %s closed: %s", self.name, peer, e)
        except Exception as e:
            log.exception("%s connection from %s failed", self.name, peer)
            if current[0] is not None:
                self.table.fail(current[0], f"receiver error: {e}")
        finally:
            self._conns.discard(sock)
            sock.close()

    def _nack(self, sock, tid, error):
        try:
            sock.settimeout(1.0)
            sock.sendall(frames.meta_frame(frames.ACK, {"tid": tid, "error": error}, a=1))
        except OSError:
            pass

    def _receive_one(self, sock: socket.socket, current: list) -> None:
        length = frames.read_prefix(sock, frames.BEGIN)[1]
        start = time.perf_counter()
        header = frames.read_meta(sock, length)
        if not isinstance(header, dict):
            raise frames.FrameError("BEGIN header is not a map")
        tid, layout = header.get("tid"), None
        try:
            layout = KVLayout.from_dict(header.get("layout"))
            if not isinstance(tid, str) or not tid or len(tid) > 256:
                raise frames.FrameError("BEGIN without a valid transfer id")
            if layout.total_nbytes > self.cfg.max_transfer_bytes:
                raise frames.FrameError(f"declared {layout.total_nbytes} bytes over limit {self.cfg.max_transfer_bytes}")
            if not self.table.begin(tid):
                raise frames.FrameError(f"transfer {tid} is not expected (duplicate or aborted)")
        except (frames.FrameError, LayoutError):
            self._refused(sock, header, layout)
            raise
        current[0] = tid
        self._receiving[tid] = sock
        try:
            result = self._receive_body(sock, tid, layout, header, start)
        finally:
            self._receiving.pop(tid, None)
        current[0] = None
        self.table.done(tid, result)
        sock.sendall(frames.meta_frame(frames.ACK, {"tid": tid}))

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        raise NotImplementedError

    def abort(self, transfer_id):
        """A transfer still arriving stops at once (its connection is dropped, its landing released)."""
        super().abort(transfer_id)
        shut_down(self._receiving.get(transfer_id))

    def _refused(self, sock, header: dict, layout: KVLayout | None) -> None:
        """Called before a BEGIN is refused (a transport whose sender may already be sending cleans up here)."""

    def _finish(self, sock, layout, start, landed: float | None = None) -> PhaseTimes:
        """Read END; the record runs from BEGIN to ``landed`` (when the bytes were in place), else to now."""
        sender = frames.read_meta(sock, frames.read_prefix(sock, frames.END)[1])
        end = time.perf_counter() if landed is None else landed
        return phases_from(sender, (end - start) * 1e3, layout.total_nbytes)

    def close(self):
        self._closing = True
        if self._server:
            self._server.close()
        for sock in list(self._conns):
            shut_down(sock)


def phases_from(sender: dict, elapsed_ms: float, nbytes: int) -> PhaseTimes:
    """Receiver-side record: the sender's own work after BEGIN is taken out of the elapsed time to leave
    ``wire``, and its connection setup before BEGIN (checkout, handshake, header) is added to it. A receiver
    that read BEGIN late sees less than the sender spent in its own send calls: that time is the floor."""
    def ms(key):
        value = sender.get(key, 0.0)
        return float(value) if isinstance(value, (int, float)) and 0 <= value < 1e9 else 0.0
    return PhaseTimes(d2h=ms("d2h"), serialize=ms("serialize"), wire=max(ms("wire"), elapsed_ms - ms("overlap") + ms("setup")), bytes=nbytes)
