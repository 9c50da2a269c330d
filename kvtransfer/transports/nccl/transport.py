"""NCCL transport: ``torch.distributed`` point-to-point from the prefill GPU to
the decode GPU (NVLink or GPUDirect RDMA), no host copies at all.

Each sender and receiver that talk form a process group of two of their own
(``pairs``: the first BEGIN to a receiver names a store the sender
started; no fixed world, so any number of prefill and decode workers, and
each rank of tensor-parallel groups, pair up as they need). Metadata
travels over the socket framing of ``sockets``: BEGIN, GRANT (the receiver
posts its ``recv``s: into blocks of the decode pool, or one into a pooled
buffer on its GPU), the sender posts the matching ``send``s, END, ACK. NCCL pairs sends and receives in the order they
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
``timeout_s``) the transfer fails at once and its pair is aborted: a send
or receive left behind would pair with the next transfer's. The next
transfer between the two forms a new pair. So a transfer whose request went
away is let finish, or dropped before its BEGIN (``cancels``); the receiver
releases what it then receives.

KV in the prefill engine's pool blocks (a ``PiecewiseKV`` on this GPU) is
sent from the blocks: BEGIN lists its pieces' sizes in tokens, the GRANT the
receiver's (when its ``land`` hook gave it blocks of the decode pool, which
is where the bytes then arrive), and both ends post one operation per layer,
K and V, and segment the two piece lists agree on, as one NCCL group.
Consecutive blocks are one piece, so a fresh pool needs 2 operations a
layer. Unless the pieces cut K or V of a layer into at most
``nccl_direct_cuts`` segments (default 0: never), the GRANT says ``whole``:
the KV then goes as one operation of the canonical buffer, gathered on the
sender (one ``cat``, counted as serialize, ``gathered_bytes``) and scattered
into the landing blocks on the receiver (one ``_foreach_copy_``, counted as
deserialize). On two H200s two device copies cost less than even 64 NCCL
operations (a Mistral-7B KV of 871 tokens from one run of blocks: 2.8 ms in
64 operations, 0.4 ms raw), and a fragmented pool makes thousands.

Layer-wise streaming (``nccl_stream=true``, off by default): BEGIN says ``streamed``; once the engine's event for
a layer completed, the sender gathers it, sends a LAYER note on the control socket and posts its send; the receiver
posts that layer's receive on the note and scatters it as it lands (no NCCL operation waits on either GPU while
layers compute). As transfers go one at a time, a prefill worker streams only while no push is in flight (a stream
holds the order for a whole forward). One prompt alone on two H200s: 0.4 ms of an 8,192-token Mistral-7B KV left
after the forward instead of 6.5 ms; 1P1D serving at concurrency 32 still does better without it (2,854 vs
1,830-2,697 output tok/s), hence off by default.

A KV the prefill engine wrote into ``alloc``'s region of the sender's
GPU slab (``nccl_pool_bytes``, allocated on first use) goes straight from
there; other layers are first gathered into a pooled staging buffer in the
canonical layout (device copy, reported as serialize; ``staged_bytes``). A
receiver without blocks takes the whole KV into a pooled buffer. Pooled
buffers share the GPU with the engine: at most ``nccl_keep_bytes`` (2 GiB) of
released ones are kept, and a full device gives them back before a transfer
fails (a 70B TP=2 rank on an 80 GB card has ~8 GB beside its weights). The
receiver's record ends when its operations have completed: the bytes are in
place then. Operations are posted on a high-priority side stream of the GPU, not the
engine's (its blocks are scheduled ahead of a busy decode engine's): KV handed to a transfer is already computed (the step that made it
was read back), so a send need not wait behind the engine's next step, and
the wait for completion sleeps between looks, leaving the GIL to the engine.
Options: ``device`` (default: the worker's engine device, else ``cuda``),
``nccl_pool_bytes``, ``nccl_keep_bytes``, ``nccl_eager``, ``nccl_direct_cuts``, ``nccl_stream``; ``nccl_backend=gloo`` runs the same protocol
between CPU processes (how CI tests it without GPUs)."""
from __future__ import annotations

import logging
import threading
import time

import torch

from ... import frames
from ...arena import Arena
from ...base import ReceivedKV, TransferError
from ...pieces import PiecewiseKV, piece_tokens, valid_piece_tokens
from ...pool import BufferPool, PoolExhausted
from ...sockets import IDLE_S, SocketReceiver, SocketSender, TableReceiver, read_grant, timed_layers
from .ops import (await_all, count_cuts, gather, layer_bytes, lock, on_side, p2p, p2p_all,
                       post, scatter, segment_ops, side_stream, sync_device, use_device, whole_pieces)
from . import same_gpu
from .cancels import CANCELLED, Cancels
from .pairs import ClosesPairs, Pairs
from ...tensors import check_layer

log = logging.getLogger(__name__)
_order = threading.Lock()
DEFAULT_POOL_BYTES = 1 << 30
DEFAULT_KEEP_BYTES = 2 << 30  # released staging / landing buffers kept on the GPU for reuse


def init(cfg) -> torch.device:
    backend = cfg.options.get("nccl_backend", "nccl")
    device = torch.device(cfg.options.get("device", "cuda" if backend == "nccl" else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def gpu_id(device) -> str:
    """The physical GPU (its UUID), the same whichever process or CUDA_VISIBLE_DEVICES names it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _attach(endpoint) -> None:
    """The GPU side of either end: device, pairs, buffer pool."""
    endpoint.device = init(endpoint.cfg)
    endpoint.pairs = Pairs(endpoint.cfg.host, endpoint.cfg.options.get("nccl_backend", "nccl"), endpoint.device,
                           endpoint.cfg.timeout_s * 4)
    endpoint.pool = BufferPool(endpoint.cfg.pool_bytes, device=endpoint.device,
                               keep_bytes=int(endpoint.cfg.options.get("nccl_keep_bytes", DEFAULT_KEEP_BYTES)))


class NcclSender(ClosesPairs, SocketSender):
    name = "nccl"
    sends_pieces = True
    one_at_a_time = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self._eager_limits: dict[str, tuple[int, float]] = {}
        self._eager, self._dest, self.eager_sends, self.piece_sends = False, "", 0, 0
        self.gathered_bytes = self.ipc_sends = 0
        self.streams_layers = self.cfg.flag("nccl_stream", False)
        self.cancels = Cancels(lambda tid: SocketSender.cancel(self, tid))

    def takes_pieces(self, device) -> bool:
        return torch.device(device) == self.device

    def cancel(self, transfer_id: str) -> None:
        if transfer_id in self._sending:  # without cutting a transfer under way at once (``cancels``)
            self.cancels.cancel(transfer_id)

    def send(self, dest, transfer_id, layout, layers, meta=None):
        """A transfer that failed other than by a clean refusal (or a cancel before its BEGIN) may leave an
        operation of its pair behind: the pair is dropped and the next transfer to ``dest`` forms a new one."""
        self.cancels.starting(transfer_id)
        try:
            return super().send(dest, transfer_id, layout, layers, meta)
        except TransferError as e:
            cause = str(e.__cause__ or "")
            if ("receiver refused" not in cause or "pair unusable" in cause) and CANCELLED not in cause:
                pair = self.pairs.by_key.get(dest)
                if pair is not None:
                    pair.abort(f"a transfer to {dest} failed: {e}")
            raise
        finally:
            self.cancels.done(transfer_id)

    def alloc(self, layout, device="cpu"):
        if torch.device(device) != self.device:
            return None
        with lock:
            if self.owned is None:
                nbytes = int(self.cfg.options.get("nccl_pool_bytes", DEFAULT_POOL_BYTES))
                self.owned = Arena(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return self.owned.source(layout)

    def _ordered(self):
        return _order

    def _begin_fields(self, dest, idle_for, layout, payload) -> dict:
        self.cancels.check()
        self._dest = dest
        self._pair, new = self.pairs.for_dest(dest)
        pair = {"pair": self._pair.key, **({"gpu": gpu_id(self.device)} if self.device.type == "cuda" else {})}
        if isinstance(payload, PiecewiseKV):
            self._eager = False
            return {**pair, "pieces": piece_tokens(payload), **({"streamed": True} if payload.gate is not None else {})}
        limit, fresh_s = self._eager_limits.get(dest, (0, 0.0)) if not new else (0, 0.0)
        self._eager = (isinstance(payload, slice) and layout.total_nbytes <= limit
                       and idle_for is not None and idle_for < fresh_s)
        self.eager_sends += self._eager
        return {**pair, "eager": True} if self._eager else pair

    def _send_body(self, sock, layout, layers, phases) -> float:
        theirs, whole, pair = None, False, self._pair
        if not self._eager:
            grant = read_grant(sock, {"rank": int, "eager_bytes": int, "eager_idle_s": float})
            self._eager_limits[self._dest] = (grant["eager_bytes"], grant["eager_idle_s"])
            if grant.get("ipc") is True:  # the receiver is on this GPU: no pair (``same_gpu``)
                return same_gpu.send(self, sock, layout, layers, phases)
            whole = grant.get("whole") is True
            if "pieces" in grant and not whole:
                theirs = valid_piece_tokens(grant["pieces"], layout.num_tokens)
        pair.pg  # made after the GRANT, as the receiver makes its own (gloo's wait for each other)
        dst = pair
        use_device(self.device)
        if isinstance(layers, PiecewiseKV) and whole:
            waited = self._send_gathered(layers.check(), layout, dst, sock, phases)
            return phases.serialize / 1e3 + waited
        if isinstance(layers, PiecewiseKV):
            t0, failed = time.perf_counter(), None
            try:
                for i in range(layout.num_layers):
                    layers.ready(i)
            except Exception as e:  # the forward failed: send anyway, so sends and receives pair
                failed = e
            waited = time.perf_counter() - t0
            with phases.measure("serialize"):
                ops = segment_ops("send", layers.check().layers, theirs or [layout.num_tokens])
            with phases.measure("wire"):
                p2p_all(ops, dst, sock, self.cfg.timeout_s)
            if failed:
                raise TransferError(f"the KV was never computed: {failed}")
            self.piece_sends += 1
            return phases.serialize / 1e3 + waited
        if isinstance(layers, slice):
            self._send_whole(self.owned.memory[layers], layout, theirs, dst, sock, phases)
            return phases.serialize / 1e3
        staging = self.pool.acquire(layout.total_nbytes)
        try:
            waited = self.stage_layers(layers, layout, staging[:layout.total_nbytes], phases)
            self._send_whole(staging[:layout.total_nbytes], layout, theirs, dst, sock, phases)
        finally:
            self.pool.release(staging)
        return (phases.d2h + phases.serialize) / 1e3 + waited

    def stage_layers(self, layers, layout, buffer, phases) -> float:
        """Layers given as ``(k, v)`` pairs joined into ``buffer`` (canonical, on this GPU); returns the seconds
        spent waiting for them."""
        parts, waited = [], [0.0]
        for _, (k, v), waited in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = (t.to(self.device) for t in (k, v))
            with phases.measure("serialize"):
                check_layer(layout, k, v)
                parts += [t.contiguous().view(-1).view(torch.uint8) for t in (k, v)]
        with phases.measure("serialize"):
            torch.cat(parts, out=buffer)
            sync_device(self.device)
            self.staged_bytes += layout.total_nbytes
        return waited[0]

    def _send_gathered(self, kv: PiecewiseKV, layout, dst, sock, phases) -> float:
        """KV in blocks as one canonical buffer; KV still being computed goes one operation per layer: once the
        engine's event for a layer completed, the layer is gathered, a LAYER note tells the receiver to post its
        receive, and the send is posted (a forward that fails stops the notes: every posted send has its receive).
        Returns the seconds spent waiting for layers."""
        nbytes, waited = layout.total_nbytes, 0.0
        try:
            staging, pooled = self.pool.acquire(nbytes), True
        except PoolExhausted:
            staging, pooled = torch.empty(nbytes, dtype=torch.uint8, device=self.device), False
        try:
            if kv.gate is None:
                with phases.measure("serialize"):
                    gather(kv.layers, staging, layout)
                works = post([("send", staging[:nbytes])], dst)
            else:
                works = []
                for i in range(len(kv.layers)):
                    try:
                        waited += kv.ready(i)  # on the host: no operation waits on either GPU while layers compute
                    except Exception:  # the forward failed: let the posted sends (all received) finish with the buffer
                        await_all(works, self.device, sock, self.cfg.timeout_s, dst)
                        raise
                    gather(kv.layers[i:i + 1], layer_bytes(staging, layout, i), layout)
                    sock.sendall(frames.prefix(frames.LAYER, i, layout.layer_nbytes))
                    works += post([("send", layer_bytes(staging, layout, i))], dst)
            self.gathered_bytes += nbytes
            with phases.measure("wire"):
                await_all(works, self.device, sock, self.cfg.timeout_s, dst)
        finally:
            if pooled:
                self.pool.release(staging)
        return waited

    def _send_whole(self, buffer, layout, theirs, dst, sock, phases) -> None:
        """A canonical buffer: one send, or one per segment when the receiver lands it in pieces."""
        ops = [("send", buffer)] if theirs is None else segment_ops("send", whole_pieces(buffer, layout), theirs)
        with phases.measure("wire"):
            p2p_all(ops, dst, sock, self.cfg.timeout_s)


class NcclReceiver(ClosesPairs, SocketReceiver):
    name = "nccl"
    lands_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self.drained = self.scattered_bytes = self.ipc_receives = 0
        self.direct_cuts = int(self.cfg.options.get("nccl_direct_cuts", 0))

    def lands_on(self, device) -> bool:
        return torch.device(device) == self.device

    def abort(self, transfer_id):
        """A transfer already arriving finishes into its landing, which is then released: its operations are posted
        or about to be, and dropping the connection would abort the pair (a new communicator for the next KV)."""
        TableReceiver.abort(self, transfer_id)

    @property
    def eager_bytes(self) -> int:
        on = self.cfg.flag("nccl_eager", True)
        return min(self.cfg.max_transfer_bytes, self.pool.capacity_bytes) if on else 0

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        use_device(self.device)
        if not isinstance(header.get("pair"), str):
            raise frames.FrameError("a BEGIN without its pair (a sender of another version?)")
        if same_gpu.shares_gpu(header, self.device, gpu_id):
            return same_gpu.receive(self, sock, tid, layout, header, start)  # NCCL cannot pair one GPU
        pair = self.pairs.join(header["pair"])
        eager, nbytes, meta = header.get("eager") is True, layout.total_nbytes, header.get("meta") or {}
        theirs = header.get("pieces")
        if theirs is not None:
            if eager:
                raise frames.FrameError("an eager BEGIN cannot send pieces")
            theirs = valid_piece_tokens(theirs, layout.num_tokens)
        landing = None if eager or self.land is None else self.land(tid, layout)
        mine = landing.kv.check().layers if landing is not None else None
        whole = not eager and count_cuts(mine, theirs, layout.num_tokens) > self.direct_cuts
        buf = None
        if landing is None or whole:
            try:
                buf = self.pool.acquire(nbytes)
            except PoolExhausted:
                if eager:
                    self._drain(sock, nbytes, pair)
                if landing is None:
                    raise
                whole = False
        release = landing.release if landing is not None else (lambda: self.pool.release(buf))
        try:
            if not eager:
                idle_s = float(self.cfg.options.get("idle_s", IDLE_S))
                grant = {"rank": pair.me, "eager_bytes": self.eager_bytes, "eager_idle_s": idle_s / 2}
                if whole:
                    grant["whole"] = True
                elif mine is not None:
                    grant["pieces"] = [p.shape[0] for p in mine[0][0]]
                sock.sendall(frames.meta_frame(frames.GRANT, grant))
                pair.pg  # made as the sender makes its own
            peer, scatter_ms = pair, 0.0
            if whole and header.get("streamed") is True:
                self._receive_layers(buf, mine, layout, peer, sock)
            else:
                if whole or (mine is None and theirs is None):
                    ops = [("recv", buf[:nbytes])]
                else:
                    ops = segment_ops("recv", mine if mine is not None else whole_pieces(buf, layout), theirs or [layout.num_tokens])
                p2p_all(ops, peer, sock, self.cfg.timeout_s)
                if whole and mine is not None:
                    t0 = time.perf_counter()
                    scatter(buf, mine, layout)
                    scatter_ms = (time.perf_counter() - t0) * 1e3
            if whole and mine is not None:
                self.scattered_bytes += nbytes
            phases = self._finish(sock, layout, start, landed=time.perf_counter())
            phases.deserialize, phases.wire = scatter_ms, max(0.0, phases.wire - scatter_ms)
        except BaseException:
            release()
            raise
        finally:
            if landing is not None and buf is not None:
                self.pool.release(buf)
        if landing is not None:
            return ReceivedKV(tid, layout, None, phases, release, meta, landed=landing.kv)
        return ReceivedKV(tid, layout, buf[:nbytes], phases, release, meta)

    def _receive_layers(self, buf, mine, layout, peer, sock) -> None:
        """A streamed KV: one receive per layer, posted when the sender's LAYER note says the layer is on its way,
        each scattered into its blocks as soon as it arrived (ordered on the GPU; on the CPU after all arrived)."""
        works = []
        for i in range(layout.num_layers):
            index, nbytes = frames.read_prefix(sock, frames.LAYER)
            if index != i or nbytes != layout.layer_nbytes:
                raise frames.FrameError(f"layer note {index}/{nbytes}B, expected {i}/{layout.layer_nbytes}B")
            works += post([("recv", layer_bytes(buf, layout, i))], peer)
            if self.device.type == "cuda" and mine is not None:
                with on_side(self.device):
                    works[-1].wait()
                scatter(layer_bytes(buf, layout, i), mine[i:i + 1], layout, sync=False)
        await_all(works, self.device, sock, self.cfg.timeout_s, peer)
        if mine is not None and self.device.type != "cuda":
            scatter(buf, mine, layout)
        elif mine is not None:
            side_stream(self.device).synchronize()

    def _refused(self, sock, header, layout) -> None:
        if header.get("eager") is True and layout is not None and layout.total_nbytes <= self.eager_bytes \
                and isinstance(header.get("pair"), str):
            self._drain(sock, layout.total_nbytes, self.pairs.join(header["pair"]))

    def _drain(self, sock, nbytes: int, pair) -> None:
        """Take an eager send this receiver will not keep, so later sends and receives stay paired."""
        use_device(self.device)
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        p2p("recv", scratch, pair, sock, self.cfg.timeout_s)
        self.drained += 1
