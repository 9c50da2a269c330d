"""Router side of the control plane: one zmq DEALER per worker (asyncio),
heartbeats, and delivery of worker messages to the request that owns them."""
from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from control.messages import MAX_MESSAGE_BYTES, MessageError, decode, encode

log = logging.getLogger(__name__)


class WorkerClient:
    def __init__(self, address: str, role: str, inboxes: dict, heartbeat_s: float = 1.0, dead_after_s: float = 3.0):
        self.address = address
        self.role = role
        self.inboxes = inboxes
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.info: dict = {}
        self.last_pong = 0.0
        self.outstanding = 0
        self.owned: set[str] = set()
        self._sock = None
        self._tasks: list[asyncio.Task] = []

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self.last_pong < self.dead_after_s

    def start(self, ctx: zmq.asyncio.Context) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat())]

    async def send(self, op: str, **fields) -> None:
        await self._sock.send(encode(op, **fields))

    async def _heartbeat(self):
        while True:
            try:
                await self.send("ping", t=time.monotonic())
            except zmq.ZMQError as e:
                log.warning("ping to %s failed: %s", self.address, e)
            await asyncio.sleep(self.heartbeat_s)
            if self.owned and not self.healthy:
                self._fail_owned(f"{self.role} worker {self.address} stopped answering")

    def _fail_owned(self, message: str):
        for rid in list(self.owned):
            inbox = self.inboxes.get(rid)
            if inbox is not None:
                inbox.put_nowait({"op": "error", "rid": rid, "status": 503, "message": message})
        self.owned.clear()

    async def _recv_loop(self):
        while True:
            raw = await self._sock.recv()
            try:
                msg = decode(raw)
            except MessageError as e:
                log.warning("bad message from %s: %s", self.address, e)
                continue
            op = msg["op"]
            if op == "pong":
                self.last_pong = time.monotonic()
                self.info = msg.get("info") or {}
                continue
            rid = msg.get("rid")
            inbox = self.inboxes.get(rid)
            if inbox is not None:
                inbox.put_nowait(msg)

    def close(self):
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            self._sock.close(0)


class WorkerGroup:
    def __init__(self, role: str, clients: list[WorkerClient], policy):
        self.role = role
        self.clients = clients
        self.policy = policy

    def healthy(self) -> list[WorkerClient]:
        return [c for c in self.clients if c.healthy]

    def pick(self) -> WorkerClient | None:
        ready = self.healthy()
        return self.policy.pick(ready) if ready else None
