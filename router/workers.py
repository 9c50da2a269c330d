"""Router side of the control plane: one zmq DEALER per worker (asyncio),
heartbeats, and delivery of worker messages to the request that owns them
(each tagged with the client it came from, ``SOURCE``, so a failure names
its worker).

A worker is in the picks while it answers pings within ``stale_after_s``
(pings go every ``heartbeat_s``) and is not suspect; after ``dead_after_s``
without a pong the requests it owns fail. A dropped connection (seen by a
zmq socket monitor) does both at once; zmq keeps reconnecting, and the
first pong after the worker is back puts it in the picks again. A worker a
KV transfer failed to reach is suspect for ``suspect_s`` (doubling while it
keeps failing, back to the start after a request through it succeeds). With a cluster token the client
runs the handshake of ``control.auth`` first (and again whenever the worker
answers ``auth_required``, e.g. after it restarted), and checks the worker's
proof before it trusts it."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from control import auth
from control.messages import MAX_MESSAGE_BYTES, MessageError, decode, encode, unbatch

log = logging.getLogger(__name__)

SOURCE = "_from"  # the WorkerClient a message came from (router-side only, never on the wire)
SUSPECT_S, MAX_SUSPECT_S = 1.0, 30.0
POOL_KEYS = 1 << 17  # pool keys remembered for a worker that did not say how large the pool is
PICK_WAIT_S = 5.0  # how long a request waits for a worker of a role to be in the picks again before a 503


class WorkerClient:
    def __init__(self, address: str, role: str, inboxes: dict, heartbeat_s: float = 0.25, dead_after_s: float = 3.0,
                 token: bytes | None = None, stale_after_s: float = 1.0):
        self.address = address
        self.token = token
        self.authed = token is None
        self._nonce = b""
        self._answered = False
        self._hello_at = -1e9
        self.role = role
        self.inboxes = inboxes
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.stale_after_s = min(stale_after_s, dead_after_s)
        self.suspect_until = 0.0
        self.suspect_s = SUSPECT_S
        self.info: dict = {}
        self.last_pong = 0.0
        self.outstanding = 0
        self.prompt_tokens_out: dict[str, int] = {}  # rid -> uncached prompt tokens sent, until its first token
        self.owned: set[str] = set()
        self.kv_keys: set[int] = set()  # prefix-cache keys the worker holds, in its GPU pool or a tier below
        self.kv_lower: set[int] = set()  # of those, the ones held only below the GPU pool (host memory, disk)
        self.kv_disk: set[int] = set()  # of those, the ones held only on disk
        self.kv_pooled: OrderedDict[int, None] = OrderedDict()  # keys it put in the cluster-wide pool (any worker's)
        self.draining = False  # drained from the router (``router.drain``): out of the picks, its requests moved
        self._sock = self._monitor = None
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        """Connected and answering within ``dead_after_s``: what it owns keeps running."""
        return time.monotonic() - self.last_pong < self.dead_after_s

    @property
    def leaving(self) -> bool:
        """Out of the picks on purpose: drained from the router, or shutting down (its own ``draining``)."""
        return self.draining or bool(self.info.get("draining"))

    @property
    def drain_state(self) -> str:
        """``serving``; ``draining`` while it still holds requests the router gave it; ``drained``."""
        if not self.draining:
            return "serving"
        return "drained" if self.outstanding <= 0 and not self.owned else "draining"

    @property
    def healthy(self) -> bool:
        """In the picks: answered within ``stale_after_s`` and not suspect."""
        now = time.monotonic()
        return now - self.last_pong < self.stale_after_s and now >= self.suspect_until

    def release(self, rid: str) -> None:
        """``rid``'s part on this worker is done (for a prefill worker: its prompt): out of ``outstanding``."""
        self.outstanding -= 1
        self.prompt_tokens_out.pop(rid, None)

    def prompt_ms_per_token(self) -> float | None:
        """The worker's prompt time a token over its recent steps (``step_times``); None before its second
        prompt step."""
        per_token = (self.info.get("step_times") or {}).get("prompt_ms_per_token")
        return None if per_token is None else float(per_token)

    def prefill_wait_ms(self, per_token: float | None = None) -> float | None:
        """How long a prompt sent now would wait behind those already sent: their uncached tokens times the
        worker's prompt time a token (``per_token`` where it has none of its own); None where neither is known."""
        per_token = self.prompt_ms_per_token() or per_token
        if per_token is None:
            return None
        return sum(self.prompt_tokens_out.values()) * per_token

    def suspect(self, why: str) -> None:
        """Out of the picks for a while (a KV transfer to it failed), longer each time it fails again."""
        now = time.monotonic()
        if now < self.suspect_until + self.suspect_s:
            self.suspect_s = min(MAX_SUSPECT_S, self.suspect_s * 2)
        self.suspect_until = now + self.suspect_s
        log.warning("%s worker %s suspect for %.1fs: %s", self.role, self.address, self.suspect_s, why)

    def vouch(self) -> None:
        """A request through it succeeded: the next failure starts from the shortest suspicion again."""
        self.suspect_s = SUSPECT_S

    def start(self, ctx: zmq.asyncio.Context) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        for hwm in (zmq.SNDHWM, zmq.RCVHWM):  # no limit: the worker's replies must all arrive (small messages)
            self._sock.setsockopt(hwm, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat()),
                       asyncio.create_task(self._watch(self._monitor))]

    async def send(self, op: str, **fields) -> None:
        await self._sock.send(encode(op, **fields))

    async def _hello(self):
        self.authed = self._answered = False
        self._nonce, self._hello_at = auth.nonce(), time.monotonic()
        await self.send("hello", nonce=self._nonce)

    async def _on_challenge(self, msg):
        ns = msg.get("nonce")
        if msg.get("for_nonce") != self._nonce:
            return
        if not (self._nonce and auth.valid_nonce(ns) and auth.verify(self.token, "server", self._nonce, ns, msg.get("proof"))):
            log.error("%s worker %s failed the cluster-token handshake (wrong token?)", self.role, self.address)
            return
        self._answered = True
        await self.send("auth", proof=auth.proof(self.token, "client", ns, self._nonce))

    async def _heartbeat(self):
        while True:
            try:
                if self.authed:
                    await self.send("ping", t=time.monotonic(), every=self.heartbeat_s)
                elif self.token and time.monotonic() - self._hello_at > max(5.0, 3 * self.heartbeat_s):
                    await self._hello()
            except zmq.ZMQError as e:
                log.warning("ping to %s failed: %s", self.address, e)
            await asyncio.sleep(self.heartbeat_s)
            if self.owned and not self.alive:
                self.fail_owned(f"{self.role} worker {self.address} stopped answering")

    async def _watch(self, monitor):
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                log.warning("%s worker %s disconnected", self.role, self.address)
                self.last_pong = 0.0
                self.fail_owned(f"{self.role} worker {self.address} disconnected")

    def fail_owned(self, message: str):
        for rid in list(self.owned):
            inbox = self.inboxes.get(rid)
            if inbox is not None:
                inbox.put_nowait({"op": "error", "rid": rid, "status": 503, "message": message, "retry_after": 1,
                                  "lost": True, SOURCE: self})
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
            if op == "auth_required":
                if not self.token:
                    log.error("%s worker %s requires a cluster token; give the router the same token",
                              self.role, self.address)
                elif self.authed:
                    await self._hello()
                continue
            if op == "challenge" and self.token:
                await self._on_challenge(msg)
                continue
            if op == "welcome" and self.token and self._answered:
                self.authed = True
                await self.send("ping", t=time.monotonic(), every=self.heartbeat_s)
                continue
            if not self.authed:
                continue
            if op == "pong":
                self.last_pong = time.monotonic()
                self.info = msg.get("info") or {}
                continue
            if op == "kv_events":
                self._on_kv_events(msg)
                continue
            try:
                items = unbatch(msg)
            except MessageError as e:
                log.warning("bad batch from %s: %s", self.address, e)
                continue
            for item in items:
                inbox = self.inboxes.get(item.get("rid"))
                if inbox is not None:
                    item[SOURCE] = self
                    inbox.put_nowait(item)

    def _on_kv_events(self, msg: dict) -> None:
        """The worker's prefix-cache keys: a full list (``reset``) on a new connection, then what was stored,
        demoted (evicted from its GPU pool into a tier below), sunk (passed down to disk) and evicted, applied in
        that order; and what it put in the cluster-wide pool (``pooled``)."""
        stored, evicted, demoted = msg.get("stored") or [], msg.get("evicted") or [], msg.get("demoted") or []
        sunk, pooled = msg.get("sunk") or [], msg.get("pooled") or []
        if not all(isinstance(keys, list) for keys in (stored, evicted, demoted, sunk, pooled)):
            return
        self._remember_pooled(pooled)
        if msg.get("reset"):
            self.kv_keys, self.kv_lower, self.kv_disk = set(stored), set(), set()
        else:
            self.kv_keys.update(stored)
            self.kv_lower.difference_update(stored)
            self.kv_disk.difference_update(stored)
        self.kv_lower.update(demoted)
        self.kv_keys.update(demoted)
        self.kv_disk.difference_update(demoted)
        self.kv_disk.update(key for key in sunk if key in self.kv_lower)
        for keys in (self.kv_keys, self.kv_lower, self.kv_disk):
            keys.difference_update(evicted)

    def _remember_pooled(self, keys: list[int]) -> None:
        """Keys the worker put in the cluster-wide pool (kept through its restarts: the store holds them, not it),
        the most recent as many as the pool holds (``pool_capacity_blocks``; the store drops the least recently
        used)."""
        for key in keys:
            self.kv_pooled[key] = None
            self.kv_pooled.move_to_end(key)
        cap = int(self.info.get("pool_capacity_blocks") or POOL_KEYS)
        while len(self.kv_pooled) > cap:
            self.kv_pooled.popitem(last=False)

    def close(self):
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)


class WorkerGroup:
    def __init__(self, role: str, clients: list[WorkerClient], policy):
        self.role = role
        self.clients = clients
        self.policy = policy

    def healthy(self, avoid=()) -> list[WorkerClient]:
        """The workers to pick from: those in the picks, else (all late on their pong at once, as on a loaded
        machine) those still alive; without the ones in ``avoid`` unless only those are left."""
        ready = [c for c in self.clients if c.healthy and not c.leaving] or \
            [c for c in self.clients if c.alive and time.monotonic() >= c.suspect_until and not c.leaving]
        return [c for c in ready if c not in avoid] or ready

    async def wait_healthy(self, avoid=(), wait_s: float = PICK_WAIT_S) -> list[WorkerClient]:
        """``healthy(avoid)``, waiting up to ``wait_s`` for one while there is none (every worker late on its pong
        or suspect for a moment: a loaded host, a worker restarting); still none after it: logged, empty."""
        end = time.monotonic() + wait_s
        while not (ready := self.healthy(avoid)) and self.clients and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if not ready:
            log.warning("no %s worker in the picks after %.1fs: %s", self.role, wait_s, self.describe())
        return ready

    def describe(self) -> str:
        now = time.monotonic()
        return ", ".join(f"{c.address} pong {now - c.last_pong:.1f}s ago, suspect {max(0.0, c.suspect_until - now):.1f}s"
                         f"{', leaving' if c.leaving else ''}" for c in self.clients) or "none"

    def ready(self) -> bool:
        """Some worker is in the picks by its own heartbeat (no fallback)."""
        return any(c.healthy and not c.leaving for c in self.clients)

    def pick(self, prompt=None, avoid=()) -> WorkerClient | None:
        ready = self.healthy(avoid)
        return self.policy.pick(ready, prompt) if ready else None


def pair_mismatch(prefill: dict, decode: dict) -> str | None:
    """Why a prefill worker's KV cannot go to a decode worker (as the fix to name), or None."""
    pm, dm = prefill.get("model"), decode.get("model")
    if pm and dm and pm != dm:
        return f"they serve different models ({pm!r} and {dm!r}): start both roles with the same --model"
    pg, dg = prefill.get("kv_geometry"), decode.get("kv_geometry")
    if pg and dg and list(pg) != list(dg):
        return (f"their KV shapes differ (layers, KV heads, head size {pg} and {dg}): the same --model on both, "
                "any --tp and --dtype")
    return None
