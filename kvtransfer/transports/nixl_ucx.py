"""NIXL transport (UCX backend: RDMA verbs when a NIC is present, TCP or
shared memory otherwise; ``UCX_TLS`` passes through).

Memory is registered once: receiver and sender each allocate one slab at
startup (``nixl_pool_bytes``), register it with their NIXL agent and carve
per-transfer regions out of it (``Arena``), so no request registers memory
(``registrations`` counts them: the slab, and a worker's KV pool where it
``share``s it, all at startup) and agent metadata never changes after startup. Metadata goes over the
socket framing of ``sockets``: BEGIN, then the receiver answers GRANT with
its agent name, agent metadata (only re-sent when its registrations change)
and the destination address; the sender posts one one-sided WRITE per layer
into the destination from a staging region it copies the layer into first
(``staged_bytes``) unless the layer already lies in the registered slab; a KV
that fills one region of it in the canonical order (what the prefill engine
writes into ``alloc``'s region) goes as a single WRITE. The (last) WRITE
carries the transfer id as notification; the receiver polls for it (which
also drives its side of the transfer), then reads END (sent once every WRITE
is DONE) and ACKs.

A prefill worker whose KV pool is in host memory hands it to the sender once
(``share``, registered at startup): KV in the pool's blocks (a
``PiecewiseKV``) then goes as one WRITE from the blocks, nothing copied.
A decode worker whose KV pool is in host memory hands it to the receiver
once (``share``: registered with the agent at startup, so still no
registration per request); its ``land`` hook then names the blocks reserved
for a transfer and the GRANT carries them as ``blocks`` (``{bases, rel,
sizes}`` addresses, see ``pieces.block_map``) instead of ``addr``: the
sender's WRITEs go straight into the decode pool's blocks, each local layer
split into descriptors that match the blocks' runs.

NIXL's progress thread is off unless ``nixl_progress_thread`` is set: it spins
a core per agent even when idle; the sender drives progress while it waits
for its WRITEs and the receiver while it waits for the notification, from as
many threads as there are transfers (the agent runs in strict thread-safe mode)."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from .. import frames
from ..base import ReceivedKV, TransferError
from ..arena import Arena
from ..pieces import PiecewiseKV, block_map, block_runs
from ..sockets import SocketReceiver, SocketSender, peer_hung_up, read_grant, timed_layers
from ..tensors import check_layer, to_host

log = logging.getLogger(__name__)


DEFAULT_POOL_BYTES = 1 << 30


class Agent:
    """A NIXL agent plus one slab of host memory registered with it once."""

    def __init__(self, role: str, pool_bytes: int, progress_thread: bool = False):
        self.name = f"pdserve-{role}-{uuid.uuid4().hex[:10]}"
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(self.name, config)
        slab = torch.zeros(pool_bytes, dtype=torch.uint8)
        self._registration = self.agent.register_memory(slab)
        self.registrations = 1
        self.arena = Arena(slab)
        self.metadata = self.agent.get_agent_metadata()
        self.extra: list = []
        self.notifs: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def register(self, memory: torch.Tensor) -> None:
        """Register more memory once (before any transfer: the agent's metadata changes)."""
        self.extra.append(self.agent.register_memory(memory))
        self.registrations += 1
        self.metadata = self.agent.get_agent_metadata()

    def wait_notif(self, tag: bytes, timeout: float, sock=None) -> None:
        """Poll for ``tag`` (driving progress); fail early when ``sock``'s peer hangs up."""
        end, polls = time.monotonic() + timeout, 0
        while True:
            with self._lock:
                for msgs in self.agent.get_new_notifs().values():
                    for m in msgs:
                        self.notifs[m] = self.notifs.get(m, 0) + 1
                if self.notifs.get(tag):
                    self.notifs[tag] -= 1
                    if not self.notifs[tag]:
                        del self.notifs[tag]
                    return
            polls += 1
            if time.monotonic() > end:
                raise TimeoutError(f"no NIXL notification for {tag!r}")
            if sock is not None and polls % 256 == 0 and peer_hung_up(sock):
                raise ConnectionError("sender hung up before its WRITEs arrived")
            time.sleep(0)


def agent_for(role: str, cfg) -> Agent:
    opts = cfg.options
    return Agent(role, int(opts.get("nixl_pool_bytes", DEFAULT_POOL_BYTES)), bool(opts.get("nixl_progress_thread", False)))


def _descs(base: int, layout, layer: int):
    off, n = base + layout.layer_offset(layer), layout.tensor_nbytes
    return [(off, n, 0), (off + n, n, 0)]


def _match(local: list, remote: list) -> tuple[list, list]:
    """Descriptors for bytes laid out as ``local`` here and ``remote`` there (lists of ``(address, nbytes)`` covering
    the same number of bytes), cut at every boundary of either side."""
    out_l, out_r = [], []
    li, ri = iter(local), iter(remote)
    (la, ln), (ra, rn) = next(li), next(ri)
    while True:
        n = min(ln, rn)
        out_l.append((la, n, 0))
        out_r.append((ra, n, 0))
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if not ln:
            nxt = next(li, None)
            if nxt is None:
                break
            la, ln = nxt
        if not rn:
            ra, rn = next(ri)
    return out_l, out_r


def _remote_layer(grant: dict, blocks, layout, layer: int) -> list:
    """Where layer ``layer``'s K then V bytes go on the receiver, as ``(address, nbytes)`` runs."""
    if blocks is not None:
        return blocks[layer][0] + blocks[layer][1]
    return [(a, n) for a, n, _ in _descs(grant["addr"], layout, layer)]


def _paired(grant: dict, blocks, layout, sources) -> tuple[list, list]:
    """Local and remote descriptors for every layer; ``sources[i]`` is layer ``i``'s local ``(address, nbytes)`` runs,
    K's then V's."""
    local, remote = [], []
    for i, mine in enumerate(sources):
        l, r = _match(mine, _remote_layer(grant, blocks, layout, i))
        local += l
        remote += r
    return local, remote


class NixlSender(SocketSender):
    name = "nixl"
    streams_layers = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.nixl = agent_for("prefill", self.cfg)
        self.owned = self.nixl.arena
        self.pool_memory: torch.Tensor | None = None
        self._peers: set[str] = set()
        self._peer_lock = threading.Lock()

    def share(self, memory: torch.Tensor) -> None:
        """Register the prefill KV pool's memory once: KV in its blocks (a ``PiecewiseKV``) is written from there."""
        self.nixl.register(memory)
        self.pool_memory = memory
        self.sends_pieces = True

    def _in_pool(self, kv: PiecewiseKV) -> bool:
        if self.pool_memory is None:
            return False
        low = self.pool_memory.data_ptr()
        high = low + self.pool_memory.numel()
        return all(low <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= high
                   for pair in kv.layers for pieces in pair for p in pieces)

    @property
    def registrations(self) -> int:
        return self.nixl.registrations

    def _peer(self, grant: dict) -> str:
        with self._peer_lock:
            if grant["agent"] not in self._peers:
                added = self.nixl.agent.add_remote_agent(grant["meta"])
                if (added.decode() if isinstance(added, bytes) else added) != grant["agent"]:
                    raise frames.FrameError("NIXL metadata does not match the agent name")
                self._peers.add(grant["agent"])
        return grant["agent"]

    def alloc(self, layout, device="cpu"):
        return self.nixl.arena.source(layout) if device == "cpu" else None

    def _send_body(self, sock, layout, layers, phases) -> float:
        grant = read_grant(sock, {"agent": str, "meta": bytes, "tag": bytes})
        blocks = block_runs(grant["blocks"], layout) if isinstance(grant.get("blocks"), dict) else None
        if blocks is None and not isinstance(grant.get("addr"), int):
            raise frames.FrameError("GRANT without addr or blocks")
        if isinstance(layers, slice):
            return self._send_placed(layers, grant, phases, layout, blocks)
        if isinstance(layers, PiecewiseKV):
            if self._in_pool(layers.check()):
                return self._send_pieces(layers, grant, phases, layout, blocks)
            waited = sum(layers.ready(i) for i in range(layout.num_layers))
            return self._send_layers(layers.whole(), grant, phases, layout, blocks) + waited
        return self._send_layers(layers, grant, phases, layout, blocks)

    def _send_layers(self, layers, grant, phases, layout, blocks) -> float:
        peer, agent, arena = self._peer(grant), self.nixl.agent, self.nixl.arena
        slot, handles, waited, n = None, [], [0.0], layout.tensor_nbytes
        try:
            for i, (k, v), waited in timed_layers(layers, layout.num_layers):
                with phases.measure("d2h"):
                    k, v = to_host(k), to_host(v)
                with phases.measure("serialize"):
                    check_layer(layout, k, v)
                    if not (arena.holds(k) and arena.holds(v)):
                        if slot is None:
                            slot, staging = arena.acquire(layout.total_nbytes)
                        off = layout.layer_offset(i)
                        k = staging[off:off + n].copy_(k.reshape(-1).view(torch.uint8))
                        v = staging[off + n:off + 2 * n].copy_(v.reshape(-1).view(torch.uint8))
                        self.staged_bytes += 2 * n
                with phases.measure("wire"):
                    last = i == layout.num_layers - 1
                    local, remote = _match([(k.data_ptr(), n), (v.data_ptr(), n)], _remote_layer(grant, blocks, layout, i))
                    self._post(peer, local, remote, grant["tag"] if last else b"", handles)
            with phases.measure("wire"):
                self._wait(handles)
        finally:
            for h in handles:
                agent.release_xfer_handle(h)
            if slot is not None:
                arena.release(slot)
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]

    def _send_placed(self, span, grant, phases, layout, blocks) -> float:
        """One WRITE of a KV that already fills one region of the registered slab (into the decode pool's blocks
        when the GRANT names them)."""
        n = span.stop - span.start
        with phases.measure("wire"):
            start, size = self.nixl.arena.memory.data_ptr() + span.start, layout.tensor_nbytes
            if blocks is not None:
                starts = [start + layout.layer_offset(i) for i in range(layout.num_layers)]
                local, remote = _paired(grant, blocks, layout, [[(k, size), (k + size, size)] for k in starts])
            else:
                local, remote = [(start, n, 0)], [(grant["addr"], n, 0)]
            self._write_once(self._peer(grant), local, remote, grant["tag"])
        return phases.serialize / 1e3

    def _send_pieces(self, kv, grant, phases, layout, blocks) -> float:
        """One WRITE from the prefill pool's blocks (registered once) to the decode pool's blocks or buffer; KV still
        being computed goes as one WRITE per layer, each posted once the engine wrote it (the last one tagged)."""
        with phases.measure("serialize"):
            sources = [[(p.data_ptr(), p.numel() * p.element_size()) for p in (*ks, *vs)] for ks, vs in kv.layers]
            if kv.gate is None:
                local, remote = _paired(grant, blocks, layout, sources)
        if kv.gate is None:
            with phases.measure("wire"):
                self._write_once(self._peer(grant), local, remote, grant["tag"])
            return phases.serialize / 1e3
        peer, handles, waited = self._peer(grant), [], 0.0
        try:
            for i, mine in enumerate(sources):
                waited += kv.ready(i)
                local, remote = _match(mine, _remote_layer(grant, blocks, layout, i))
                self._post(peer, local, remote, grant["tag"] if i == len(sources) - 1 else b"", handles)
            self._wait(handles)
        finally:
            for h in handles:
                self.nixl.agent.release_xfer_handle(h)
        return phases.serialize / 1e3 + waited

    def _post(self, peer, local: list, remote: list, tag: bytes, handles: list) -> None:
        """Post one WRITE of ``(address, nbytes, 0)`` descriptors; its handle joins ``handles`` (the caller releases)."""
        agent = self.nixl.agent
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"),
                                       peer, tag)
        handles.append(handle)
        if agent.transfer(handle) == "ERR":
            raise TransferError("NIXL WRITE could not be posted")

    def _write_once(self, peer, local: list, remote: list, tag: bytes) -> None:
        handles = []
        try:
            self._post(peer, local, remote, tag, handles)
            self._wait(handles)
        finally:
            for h in handles:
                self.nixl.agent.release_xfer_handle(h)

    def _wait(self, handles):
        end = time.monotonic() + self.cfg.timeout_s
        pending = list(handles)
        while pending:
            state = self.nixl.agent.check_xfer_state(pending[0])
            if state == "ERR":
                raise TransferError("NIXL WRITE failed")
            if state == "DONE":
                pending.pop(0)
            elif time.monotonic() > end:
                raise TransferError("NIXL WRITE timed out")


class NixlReceiver(SocketReceiver):
    name = "nixl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.nixl = agent_for("decode", self.cfg)
        self.pool_memory: torch.Tensor | None = None

    def share(self, memory: torch.Tensor) -> None:
        """Register the decode KV pool's memory once and land transfers in its blocks (through ``land``)."""
        self.nixl.register(memory)
        self.pool_memory = memory
        self.lands_pieces = True

    @property
    def registrations(self) -> int:
        return self.nixl.registrations

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        landing = self.land(tid, layout) if self.land and self.pool_memory is not None else None
        blocks = block_map(landing.kv.check(), self.pool_memory, absolute=True) if landing else None
        if landing is not None and blocks is None:
            landing.release()
        elif landing is not None:
            tag = uuid.uuid4().bytes
            try:
                grant = {"agent": self.nixl.name, "meta": self.nixl.metadata, "blocks": blocks, "tag": tag}
                sock.sendall(frames.meta_frame(frames.GRANT, grant))
                self.nixl.wait_notif(tag, self.cfg.timeout_s, sock)
                phases = self._finish(sock, layout, start)
            except TimeoutError as e:
                landing.release()
                raise ConnectionError(str(e)) from None
            except BaseException:
                landing.release()
                raise
            return ReceivedKV(tid, layout, None, phases, landing.release, meta, landed=landing.kv)
        slot, buf = self.nixl.arena.acquire(layout.total_nbytes)
        tag = uuid.uuid4().bytes
        try:
            grant = {"agent": self.nixl.name, "meta": self.nixl.metadata, "addr": buf.data_ptr(), "tag": tag}
            sock.sendall(frames.meta_frame(frames.GRANT, grant))
            self.nixl.wait_notif(tag, self.cfg.timeout_s, sock)
            phases = self._finish(sock, layout, start)
        except TimeoutError as e:
            self.nixl.arena.release(slot)
            raise ConnectionError(str(e)) from None
        except BaseException:
            self.nixl.arena.release(slot)
            raise
        return ReceivedKV(tid, layout, buf, phases, lambda: self.nixl.arena.release(slot), meta)
