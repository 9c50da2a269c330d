"""NCCL transport: ``torch.distributed`` point-to-point from the prefill GPU to
the decode GPU (NVLink or GPUDirect RDMA), no host copies at all.

Like ``mlx``, NCCL ranks form a fixed world (``nccl_init`` = a
``tcp://host:port`` rendezvous, ``nccl_rank``, world size 2), so metadata
travels over the socket framing of ``sockets``: BEGIN, GRANT (the receiver
posts one ``recv`` into a pooled buffer on its GPU), the sender ``send``s the
KV in one operation, END, ACK. NCCL pairs sends and receives in the order they
are posted, and a small ``send`` may complete before its ``recv`` is posted
(NCCL buffers it), so the sender holds one lock from BEGIN until the ACK: the
receiver sees transfers one at a time, in the sender's order.

Eager sends: a GRANT also says how large a transfer the receiver takes without
one (``eager_bytes``, 0 with ``nccl_eager=false``). Later KVs that the sender
can send at once (in its slab, see below), within that size, on a connection
that was used recently, go without waiting for a GRANT: BEGIN says
``eager`` and the ``send`` is posted right behind it. The receiver then must
post a matching ``recv`` whatever happens: a BEGIN it refuses (aborted,
duplicate, no buffer) is drained into scratch memory before it is refused.

A posted operation cannot be cancelled, so each end waits for its own while
watching the control socket. If the peer hangs up (or nothing moves for
``timeout_s``) the transfer fails at once and the whole world is aborted:
a send or receive left behind would pair with the next transfer's. Later
transfers fail with "restart prefill and decode".

A KV the prefill engine wrote into ``alloc``'s region of the sender's GPU slab
(``nccl_pool_bytes``, allocated on first use) goes straight from there; other
layers are first gathered into a pooled staging buffer in the canonical layout
(device copy, reported as serialize; ``staged_bytes``). The receiver's record
ends when its ``recv`` has completed: the bytes are in place then.
Options: ``nccl_init``, ``nccl_rank``, ``device`` (default ``cuda:<rank>``),
``nccl_pool_bytes``, ``nccl_eager``; ``nccl_backend=gloo`` runs the same protocol
between CPU processes (how CI tests it without GPUs)."""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import frames
from .arena import Arena
from .base import ReceivedKV, TransferError
from .pool import BufferPool, PoolExhausted
from .sockets import IDLE_S, SocketReceiver, SocketSender, peer_hung_up, read_grant, timed_layers
from .tensors import check_layer

log = logging.getLogger(__name__)
_lock = threading.Lock()
_order = threading.Lock()
_broken: list[str] = []
SPIN_S, CHECK_S, POLL_S = 0.05, 0.001, 0.001  # spin 50 ms (looking at the socket every 1 ms), then poll
DEFAULT_POOL_BYTES = 1 << 30


def init(cfg) -> torch.device:
    opts = cfg.options
    rank, backend = int(opts.get("nccl_rank", 0)), opts.get("nccl_backend", "nccl")
    device = torch.device(opts.get("device", f"cuda:{rank}" if backend == "nccl" else "cpu"))
    with _lock:
        if not dist.is_initialized():
            if "nccl_init" not in opts:
                raise TransferError("nccl transport needs options nccl_init (tcp://host:port) and nccl_rank")
            on_gpu = {"device_id": device} if device.type == "cuda" else {}
            if on_gpu:
                torch.cuda.set_device(device)
            dist.init_process_group(backend, init_method=opts["nccl_init"], rank=rank, world_size=2,
                                    timeout=timedelta(seconds=cfg.timeout_s * 4), **on_gpu)
    return device


def _use(device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _p2p(op, tensor, peer: int, sock, timeout_s: float) -> None:
    """Post one ``isend``/``irecv`` and wait for it, watching the control socket: a peer that
    hung up (or no progress in ``timeout_s``) leaves an operation NCCL can never complete, and
    every later pair would be mismatched, so the world is aborted and all later transfers fail."""
    if _broken:
        raise TransferError(f"nccl world unusable ({_broken[0]}); restart prefill and decode")
    work = op(tensor, peer)
    done = work.is_completed if tensor.is_cuda else _waiter(work)
    start = time.perf_counter()
    next_check, deadline = start + CHECK_S, time.monotonic() + timeout_s
    while not done():
        now = time.perf_counter()
        if now < next_check:
            continue
        next_check = now + CHECK_S
        hung_up = peer_hung_up(sock, POLL_S if now - start > SPIN_S else 0)
        if hung_up or time.monotonic() > deadline:
            _abort("peer hung up mid-transfer" if hung_up else f"no progress in {timeout_s:.0f}s")
            raise TransferError(f"nccl transfer lost: {_broken[0]}")
    if tensor.is_cuda:
        work.wait()


def _waiter(work):
    """gloo marks a point-to-point operation complete only inside ``wait``: wait on a helper thread."""
    finished, failed = threading.Event(), []

    def run():
        try:
            work.wait()
        except Exception as e:
            failed.append(e)
        finished.set()
    threading.Thread(target=run, name="nccl-p2p-wait", daemon=True).start()

    def done() -> bool:
        if finished.is_set() and failed:
            raise TransferError(f"transfer failed: {failed[0]}")
        return finished.is_set()
    return done


def _abort(reason: str) -> None:
    with _lock:
        if _broken:
            return
        _broken.append(reason)
    log.error("aborting the nccl world: %s", reason)
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:  # a backend without abort (gloo) keeps its stuck operation
        log.warning("could not abort the process group: %s", e)


def _attach(endpoint) -> None:
    """The GPU side of either end: joined world, device, buffer pool."""
    endpoint.device = init(endpoint.cfg)
    endpoint.pool = BufferPool(endpoint.cfg.pool_bytes, device=endpoint.device)


class NcclSender(SocketSender):
    name = "nccl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self._eager_limits: dict[str, tuple[int, float]] = {}
        self._eager, self._dest, self.eager_sends = False, "", 0

    def alloc(self, layout, device="cpu"):
        if torch.device(device) != self.device:
            return None
        with _lock:
            if self.owned is None:
                nbytes = int(self.cfg.options.get("nccl_pool_bytes", DEFAULT_POOL_BYTES))
                self.owned = Arena(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return self.owned.source(layout)

    def _ordered(self):
        return _order

    def _begin_fields(self, dest, idle_for, layout, payload) -> dict:
        self._dest = dest
        limit, fresh_s = self._eager_limits.get(dest, (0, 0.0))
        self._eager = (isinstance(payload, slice) and layout.total_nbytes <= limit
                       and idle_for is not None and idle_for < fresh_s)
        self.eager_sends += self._eager
        return {"eager": True} if self._eager else {}

    def _send_body(self, sock, layout, layers, phases) -> float:
        if not self._eager:
            grant = read_grant(sock, {"rank": int, "eager_bytes": int, "eager_idle_s": float})
            self._eager_limits[self._dest] = (grant["eager_bytes"], grant["eager_idle_s"])
        dst = 1 - dist.get_rank()
        _use(self.device)
        if isinstance(layers, slice):
            with phases.measure("wire"):
                _p2p(dist.isend, self.owned.memory[layers], dst, sock, self.cfg.timeout_s)
            return phases.serialize / 1e3
        parts, waited = [], [0.0]
        for _, (k, v), waited in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = (t.to(self.device) for t in (k, v))
            with phases.measure("serialize"):
                check_layer(layout, k, v)
                parts += [t.contiguous().view(-1).view(torch.uint8) for t in (k, v)]
        staging = self.pool.acquire(layout.total_nbytes)
        try:
            with phases.measure("serialize"):
                torch.cat(parts, out=staging[:layout.total_nbytes])
                _sync(self.device)
                self.staged_bytes += layout.total_nbytes
            with phases.measure("wire"):
                _p2p(dist.isend, staging[:layout.total_nbytes], dst, sock, self.cfg.timeout_s)
        finally:
            self.pool.release(staging)
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]


class NcclReceiver(SocketReceiver):
    name = "nccl"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self.drained = 0

    @property
    def eager_bytes(self) -> int:
        on = str(self.cfg.options.get("nccl_eager", True)).lower() not in ("0", "false", "no", "off")
        return min(self.cfg.max_transfer_bytes, self.pool.capacity_bytes) if on else 0

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        _use(self.device)
        eager, nbytes = header.get("eager") is True, layout.total_nbytes
        try:
            buf = self.pool.acquire(nbytes)
        except PoolExhausted:
            if eager:
                self._drain(sock, nbytes)
            raise
        try:
            if not eager:
                idle_s = float(self.cfg.options.get("idle_s", IDLE_S))
                grant = {"rank": dist.get_rank(), "eager_bytes": self.eager_bytes, "eager_idle_s": idle_s / 2}
                sock.sendall(frames.meta_frame(frames.GRANT, grant))
            _p2p(dist.irecv, buf[:nbytes], 1 - dist.get_rank(), sock, self.cfg.timeout_s)
            phases = self._finish(sock, layout, start, landed=time.perf_counter())
        except BaseException:
            self.pool.release(buf)
            raise
        return ReceivedKV(tid, layout, buf[:nbytes], phases, lambda: self.pool.release(buf), header.get("meta") or {})

    def _refused(self, sock, header, layout) -> None:
        if header.get("eager") is True and layout is not None and layout.total_nbytes <= self.eager_bytes:
            self._drain(sock, layout.total_nbytes)

    def _drain(self, sock, nbytes: int) -> None:
        """Take an eager send this receiver will not keep, so later sends and receives stay paired."""
        _use(self.device)
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _p2p(dist.irecv, scratch, 1 - dist.get_rank(), sock, self.cfg.timeout_s)
        self.drained += 1
