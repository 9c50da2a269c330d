"""TCP transport: persistent connections, a msgpack header, then raw layer
buffers straight from the source tensors into ``recv_into`` of a pooled
destination buffer (framing in ``frames``). No pickle, no intermediate copy."""
from __future__ import annotations

import logging
import select
import socket
import threading
import time

from . import frames
from .base import KVReceiver, KVSender, ReceivedKV, TransferError, TransferStatus, TransportConfig
from .layout import KVLayout, LayoutError
from .phases import PhaseTimes
from .pool import BufferPool, PoolExhausted
from .state import TransferTable
from .tensors import as_bytes, check_layer, to_host

log = logging.getLogger(__name__)


def parse_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


class TcpSender(KVSender):
    name = "tcp"

    def __init__(self, cfg: TransportConfig | None = None):
        self.cfg = cfg or TransportConfig()
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def _checkout(self, dest: str) -> socket.socket:
        with self._lock:
            pool = self._idle.setdefault(dest, [])
            while pool:
                sock = pool.pop()
                readable, _, _ = select.select([sock], [], [], 0)
                if not readable:
                    return sock
                sock.close()
        sock = socket.create_connection(parse_address(dest), timeout=self.cfg.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _checkin(self, dest: str, sock: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault(dest, []).append(sock)

    def send(self, dest, transfer_id, layout: KVLayout, layers, meta=None) -> PhaseTimes:
        phases = PhaseTimes(bytes=layout.total_nbytes)
        sock = self._checkout(dest)
        ok = False
        try:
            sock.sendall(frames.meta_frame(frames.BEGIN, {"tid": transfer_id, "layout": layout.to_dict(), "meta": meta or {}}))
            waited, count, source = 0.0, 0, iter(layers)
            while True:
                t0 = time.perf_counter()
                pair = next(source, None)
                waited += time.perf_counter() - t0
                if pair is None:
                    break
                if count >= layout.num_layers:
                    raise ValueError(f"more layers than layout's {layout.num_layers}")
                with phases.measure("d2h"):
                    k, v = to_host(pair[0]), to_host(pair[1])
                with phases.measure("serialize"):
                    check_layer(layout, k, v)
                    head = frames.prefix(frames.LAYER, count, layout.layer_nbytes)
                    kb, vb = as_bytes(k), as_bytes(v)
                with phases.measure("wire"):
                    sock.sendall(head)
                    sock.sendall(kb)
                    sock.sendall(vb)
                count += 1
            if count != layout.num_layers:
                raise ValueError(f"got {count} layers, layout declares {layout.num_layers}")
            sender = {"d2h": phases.d2h, "serialize": phases.serialize, "source_wait": waited * 1e3}
            with phases.measure("wire"):
                sock.sendall(frames.meta_frame(frames.END, sender))
                status, length = frames.read_prefix(sock, frames.ACK)
                reply = frames.read_meta(sock, length)
            if status != 0:
                raise TransferError(f"receiver refused transfer {transfer_id}: {reply.get('error')}")
            ok = True
            return phases
        except (OSError, ValueError) as e:
            raise TransferError(f"transfer {transfer_id} to {dest} failed: {e}") from e
        finally:
            if ok:
                self._checkin(dest, sock)
            else:
                sock.close()

    def close(self):
        with self._lock:
            for pool in self._idle.values():
                for sock in pool:
                    sock.close()
            self._idle.clear()


class TcpReceiver(KVReceiver):
    name = "tcp"

    def __init__(self, cfg: TransportConfig | None = None, pool: BufferPool | None = None):
        self.cfg = cfg or TransportConfig()
        self.pool = pool or BufferPool(self.cfg.pool_bytes)
        self.table = TransferTable(self.cfg.lease_s, on_change=self._changed)
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._closing = False
        self.dropped_connections = 0

    def _changed(self, tid, status):
        if self.on_complete:
            self.on_complete(tid, status)

    @property
    def address(self) -> str:
        host, port = self._server.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._server = socket.create_server((self.cfg.host, self.cfg.port), backlog=128)
        self._server.settimeout(1.0)
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    def _accept_loop(self):
        while not self._closing:
            try:
                sock, peer = self._server.accept()
            except socket.timeout:
                self.table.expire()
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer), name="kv-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer):
        current: list = [None]
        try:
            while not self._closing:
                sock.settimeout(None)
                current[0] = None
                self._receive_one(sock, current)
        except (frames.FrameError, LayoutError, PoolExhausted) as e:
            self.dropped_connections += 1
            log.warning("dropping KV connection from %s: %s", peer, e)
            self._nack(sock, current[0], str(e))
            if current[0] is not None:
                self.table.fail(current[0], str(e))
        except (OSError, ConnectionError) as e:
            if current[0] is not None:
                self.table.fail(current[0], f"connection lost: {e}")
            elif not self._closing:
                log.debug("KV connection from %s closed: %s", peer, e)
        except Exception as e:
            log.exception("KV connection from %s failed", peer)
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
        sock.settimeout(self.cfg.timeout_s)
        start = time.perf_counter()
        header = frames.read_meta(sock, length)
        tid = header.get("tid")
        if not isinstance(tid, str) or not tid:
            raise frames.FrameError("BEGIN without a transfer id")
        layout = KVLayout.from_dict(header.get("layout"))
        if layout.total_nbytes > self.cfg.max_transfer_bytes:
            raise frames.FrameError(f"declared {layout.total_nbytes} bytes over limit {self.cfg.max_transfer_bytes}")
        if not self.table.begin(tid):
            raise frames.FrameError(f"transfer {tid} is not expected (duplicate or aborted)")
        current[0] = tid
        buf = self.pool.acquire(layout.total_nbytes)
        try:
            view = memoryview(buf.numpy()).cast("B")
            for i in range(layout.num_layers):
                index, nbytes = frames.read_prefix(sock, frames.LAYER)
                if index != i or nbytes != layout.layer_nbytes:
                    raise frames.FrameError(f"layer frame {index}/{nbytes}B, expected {i}/{layout.layer_nbytes}B")
                off = layout.layer_offset(i)
                frames.recv_into(sock, view[off:off + nbytes])
                if self.table.status(tid) == TransferStatus.ABORTED:
                    raise ConnectionError("aborted by receiver")
            sender = frames.read_meta(sock, frames.read_prefix(sock, frames.END)[1])
        except BaseException:
            self.pool.release(buf)
            raise
        elapsed = (time.perf_counter() - start) * 1e3
        phases = _phases_from(sender, elapsed, layout.total_nbytes)
        result = ReceivedKV(tid, layout, buf[:layout.total_nbytes], phases, lambda: self.pool.release(buf), header.get("meta") or {})
        self.table.done(tid, result)
        current[0] = None
        sock.sendall(frames.meta_frame(frames.ACK, {"tid": tid}))

    def poll(self, transfer_id):
        return self.table.status(transfer_id)

    def wait(self, transfer_id, timeout=None) -> ReceivedKV:
        return self.table.wait(transfer_id, self.cfg.timeout_s if timeout is None else timeout)

    def abort(self, transfer_id):
        self.table.abort(transfer_id)

    def close(self):
        self._closing = True
        if self._server:
            self._server.close()
        for sock in list(self._conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _phases_from(sender: dict, elapsed_ms: float, nbytes: int) -> PhaseTimes:
    def ms(key):
        value = sender.get(key, 0.0)
        return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0
    d2h, serialize, waited = ms("d2h"), ms("serialize"), ms("source_wait")
    return PhaseTimes(d2h=d2h, serialize=serialize, wire=max(0.0, elapsed_ms - d2h - serialize - waited), bytes=nbytes)
