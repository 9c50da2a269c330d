"""The step plan: what rank 0 of a tensor-parallel group tells the other ranks, and what they report back.

Rank 0 binds one zmq PUSH socket per follower (loopback; order kept per
socket) and one PULL socket for reports. Messages are msgpack maps
``{"v": PLAN_VERSION, "op": ...}``:

- ``step{rows, copies, ahead}``: copy these blocks, then run the forward of
  these rows (``StepRow.to_wire``); every rank meets the others in its
  collectives. A row whose ``feed`` is set takes its input token from the
  tokens rank 0 chose in the step before, still on the device. ``ahead``:
  rank 0 launches the next step before reading this one's tokens
  (``engine.overlap``), so after the forward it broadcasts them from its
  device over the group (one ``long`` a row) and every rank keeps them.
- ``kv_*``: KV transfer work of this rank's head slice (``kv_plan``).
- ``tier``: a copy between the KV pool and the host tier, as rank 0 made it on its own slice
  (``kvcache.mirror``); sent before the step that depends on it.
- ``stop``: leave the loop and exit.

Followers send ``report{...}`` maps back (a KV slice moved or failed)."""
from __future__ import annotations

import threading

import msgpack
import zmq

PLAN_VERSION = 2


def _pack(op: str, fields: dict) -> bytes:
    return msgpack.packb({"v": PLAN_VERSION, "op": op, **fields}, use_bin_type=True)


def _unpack(raw: bytes) -> dict:
    msg = msgpack.unpackb(raw, raw=False)
    if msg.get("v") != PLAN_VERSION:
        raise RuntimeError(f"step plan version {msg.get('v')} from rank 0, this rank speaks {PLAN_VERSION}")
    return msg


class PlanSender:
    """Rank 0's end: ``send`` to every follower; ``on_report`` gets their reports (on a thread of its own)."""

    def __init__(self, followers: int, host: str = "127.0.0.1"):
        """``host``: where the sockets listen (a pipeline whose stages run on other nodes: this node's address)."""
        self.ctx = zmq.Context.instance()
        self.socks, self.addresses = [], []
        for _ in range(followers):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{host}:*")
            self.socks.append(sock)
            self.addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(f"tcp://{host}:*")
        self.report_address = self.reports.getsockopt_string(zmq.LAST_ENDPOINT)
        self._on_report, self._early = None, []
        self.by_kind: dict = {}  # reports of these kinds go to their own handler (e.g. an mlx pipeline's hops)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._read_reports, name="tp-reports", daemon=True).start()

    def send(self, op: str, **fields) -> None:
        raw = _pack(op, fields)
        with self._lock:
            for sock in self.socks:
                sock.send(raw)

    def send_to(self, rank: int, op: str, **fields) -> None:
        """To follower ``rank`` alone (its share of something), in order with everything else it is sent."""
        raw = _pack(op, fields)
        with self._lock:
            self.socks[rank - 1].send(raw)

    def step(self, rows, copies, ahead: bool = False) -> None:
        self.send("step", rows=[r.to_wire() for r in rows], copies=[list(c) for c in copies], ahead=ahead)

    @property
    def on_report(self):
        return self._on_report

    @on_report.setter
    def on_report(self, handler) -> None:
        """Reports that came before a handler was set (a follower ready before rank 0's worker) go to it first."""
        with self._lock:
            self._on_report, early, self._early = handler, self._early, []
        for msg in early:
            handler(msg)

    def _read_reports(self) -> None:
        while not self._stop.is_set():
            if self.reports.poll(200):
                msg = _unpack(self.reports.recv())
                if msg.get("kind") in self.by_kind:
                    self.by_kind[msg["kind"]](msg)
                    continue
                with self._lock:
                    handler = self._on_report
                    if handler is None:
                        self._early.append(msg)
                if handler is not None:
                    handler(msg)

    def close(self) -> None:
        """``stop`` to every follower that can take it now (one that died has no peer: it is not waited for)."""
        raw = _pack("stop", {})
        with self._lock:
            for sock in self.socks:
                try:
                    sock.send(raw, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._stop.set()


class PlanReceiver:
    """A follower's end: ``recv`` the next plan message (None on timeout), ``report`` to rank 0 (any thread)."""

    def __init__(self, address: str, report_address: str):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.connect(address)
        self.report_address = report_address
        self._local = threading.local()

    def recv(self, timeout_ms: int) -> dict | None:
        if not self.sock.poll(timeout_ms):
            return None
        return _unpack(self.sock.recv())

    def report(self, **fields) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self.report_address)
        push.send(_pack("report", fields))
