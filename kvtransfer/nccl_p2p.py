"""NCCL transport: ``torch.distributed`` point-to-point from the prefill GPU to
the decode GPU (NVLink or GPUDirect RDMA), no host copies at all.

Like ``mlx``, NCCL ranks form a fixed world (``nccl_init`` = a
``tcp://host:port`` rendezvous, ``nccl_rank``, world size 2), so metadata
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
``timeout_s``) the transfer fails at once and the whole world is aborted:
a send or receive left behind would pair with the next transfer's. Later
transfers fail with "restart prefill and decode".

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

Layer-wise streaming (``nccl_stream=true``, off by default): BEGIN says
``streamed``; the sender gathers and sends each layer once the engine's event
for it is recorded (ordered on the GPU), the receiver posts one receive per
layer up front and scatters each as it lands. One prompt alone: 0.8 ms of
an 8,192-token Mistral-7B KV left after the forward instead of 6.3 ms. Under
load it loses: the receives wait on the decode GPU for the whole prefill
forward and transfers stay one at a time (BEGIN to ACK), so 1P1D serving at
concurrency 32 fell from ~2,750 to 470 output tok/s (TPOT 65 ms). A KV the prefill engine wrote into ``alloc``'s region of the sender's
GPU slab (``nccl_pool_bytes``, allocated on first use) goes straight from
there; other layers are first gathered into a pooled staging buffer in the
canonical layout (device copy, reported as serialize; ``staged_bytes``). A
receiver without blocks takes the whole KV into a pooled buffer. The
receiver's record ends when its operations have completed: the bytes are in
place then. Operations are posted on a high-priority side stream of the GPU, not the
engine's (its blocks are scheduled ahead of a busy decode engine's): KV handed to a transfer is already computed (the step that made it
was read back), so a send need not wait behind the engine's next step, and
the wait for completion sleeps between looks, leaving the GIL to the engine.
Options: ``nccl_init``, ``nccl_rank``, ``device`` (default ``cuda:<rank>``),
``nccl_pool_bytes``, ``nccl_eager``, ``nccl_direct_cuts``, ``nccl_stream``; ``nccl_backend=gloo`` runs the same protocol
between CPU processes (how CI tests it without GPUs)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import frames
from .arena import Arena
from .base import ReceivedKV, TransferError
from .pieces import PiecewiseKV, common_cuts, piece_tokens, segments, valid_piece_tokens
from .pool import BufferPool, PoolExhausted
from .sockets import IDLE_S, SocketReceiver, SocketSender, peer_hung_up, read_grant, timed_layers
from .tensors import TORCH_DTYPES, check_layer, unpack

log = logging.getLogger(__name__)
_lock = threading.Lock()
_order = threading.Lock()
_broken: list[str] = []
SPIN_S, CHECK_S, POLL_S = 0.05, 0.001, 0.001  # spin 50 ms (looking at the socket every 1 ms), then poll
NAP_S = 50e-6
_side_streams: dict = {}
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
    _p2p_all([(op, tensor)], peer, sock, timeout_s)


def _p2p_all(ops: list, peer: int, sock, timeout_s: float) -> None:
    """Post ``(isend|irecv, tensor)`` operations (several as one NCCL group) and wait for them (``_await``)."""
    _await(_post(ops, peer), ops[0][1].device, sock, timeout_s)


def _post(ops: list, peer: int) -> list:
    if _broken:
        raise TransferError(f"nccl world unusable ({_broken[0]}); restart prefill and decode")
    with _on_side(ops[0][1].device):
        if len(ops) == 1:
            return [ops[0][0](ops[0][1], peer)]
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer) for op, tensor in ops])


def _await(works: list, device, sock, timeout_s: float) -> None:
    """Wait for posted operations, watching the control socket: a peer that hung up (or no progress in
    ``timeout_s``) leaves an operation NCCL can never complete, and every later pair would be mismatched, so the
    world is aborted and all later transfers fail."""
    on_gpu = device.type == "cuda"
    done = (lambda: all(w.is_completed() for w in works)) if on_gpu else _waiter(works)
    start = time.perf_counter()
    next_check, deadline = start + CHECK_S, time.monotonic() + timeout_s
    while not done():
        now = time.perf_counter()
        if now < next_check:
            time.sleep(NAP_S)
            continue
        next_check = now + CHECK_S
        hung_up = peer_hung_up(sock, POLL_S if now - start > SPIN_S else 0)
        if hung_up or time.monotonic() > deadline:
            _abort("peer hung up mid-transfer" if hung_up else f"no progress in {timeout_s:.0f}s")
            raise TransferError(f"nccl transfer lost: {_broken[0]}")
    if on_gpu:
        with _on_side(device):
            for w in works:
                w.wait()


def _on_side(device):
    return torch.cuda.stream(_side_stream(device)) if device.type == "cuda" else contextlib.nullcontext()


def _rows(buffer: torch.Tensor, layout, nbytes: int | None = None) -> torch.Tensor:
    """A canonical buffer (or ``nbytes`` of it) as ``[layers * 2 * tokens, kv_heads, head_dim]`` rows."""
    nbytes = layout.total_nbytes if nbytes is None else nbytes
    return buffer[:nbytes].view(TORCH_DTYPES[layout.dtype]).view(-1, *layout.tensor_shape[1:])


def _flat(pieces: list) -> list:
    return [p for pair in pieces for side in pair for p in side]


def _gather(pieces: list, buffer: torch.Tensor, layout) -> None:
    with _on_side(buffer.device):
        torch.cat(_flat(pieces), dim=0, out=_rows(buffer, layout))


def _scatter(buffer: torch.Tensor, pieces: list, layout, sync: bool = True) -> None:
    """``buffer`` (canonical bytes of ``pieces``' layers) copied into ``pieces``."""
    dst = _flat(pieces)
    rows = _rows(buffer, layout, len(pieces) * layout.layer_nbytes)
    with _on_side(buffer.device):
        torch._foreach_copy_(dst, list(rows.split([p.shape[0] for p in dst])))
    if sync and buffer.is_cuda:
        _side_stream(buffer.device).synchronize()


def _layer_bytes(buffer: torch.Tensor, layout, i: int) -> torch.Tensor:
    return buffer[layout.layer_offset(i):layout.layer_offset(i) + layout.layer_nbytes]


def _cuts(mine: list | None, theirs: list[int] | None, tokens: int) -> int:
    return len(common_cuts([p.shape[0] for p in mine[0][0]] if mine else [tokens], theirs or [tokens]))


def _side_stream(device):
    with _lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device, priority=-1)  # ahead of the engine's kernels
        return _side_streams[device]


def _waiter(works):
    """gloo marks a point-to-point operation complete only inside ``wait``: wait on a helper thread."""
    finished, failed = threading.Event(), []

    def run():
        try:
            for work in works:
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


def _ops(op, mine: list, theirs: list[int]) -> list:
    """One ``op`` per segment that both ends' pieces agree on: per layer, K's segments then V's, as bytes.
    ``mine`` holds per layer ``(k_pieces, v_pieces)``; ``theirs`` the peer's piece sizes in tokens."""
    cuts = common_cuts([p.shape[0] for p in mine[0][0]], theirs)
    return [(op, seg.view(-1).view(torch.uint8)) for pair in mine for pieces in pair for seg in segments(pieces, cuts)]


def _whole(buffer: torch.Tensor, layout) -> list:
    """A canonical buffer as pieces (one per layer and K/V)."""
    return [([k], [v]) for k, v in unpack(buffer, layout)]


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
    sends_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self._eager_limits: dict[str, tuple[int, float]] = {}
        self._eager, self._dest, self.eager_sends, self.piece_sends = False, "", 0, 0
        self.gathered_bytes = 0
        self.streams_layers = str(self.cfg.options.get("nccl_stream", False)).lower() in ("1", "true", "yes", "on")

    def takes_pieces(self, device) -> bool:
        return torch.device(device) == self.device

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
        if isinstance(payload, PiecewiseKV):
            self._eager = False
            return {"pieces": piece_tokens(payload), **({"streamed": True} if payload.gate is not None else {})}
        limit, fresh_s = self._eager_limits.get(dest, (0, 0.0))
        self._eager = (isinstance(payload, slice) and layout.total_nbytes <= limit
                       and idle_for is not None and idle_for < fresh_s)
        self.eager_sends += self._eager
        return {"eager": True} if self._eager else {}

    def _send_body(self, sock, layout, layers, phases) -> float:
        theirs, whole = None, False
        if not self._eager:
            grant = read_grant(sock, {"rank": int, "eager_bytes": int, "eager_idle_s": float})
            self._eager_limits[self._dest] = (grant["eager_bytes"], grant["eager_idle_s"])
            whole = grant.get("whole") is True
            if "pieces" in grant and not whole:
                theirs = valid_piece_tokens(grant["pieces"], layout.num_tokens)
        dst = 1 - dist.get_rank()
        _use(self.device)
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
                ops = _ops(dist.isend, layers.check().layers, theirs or [layout.num_tokens])
            with phases.measure("wire"):
                _p2p_all(ops, dst, sock, self.cfg.timeout_s)
            if failed:
                raise TransferError(f"the KV was never computed: {failed}")
            self.piece_sends += 1
            return phases.serialize / 1e3 + waited
        if isinstance(layers, slice):
            self._send_whole(self.owned.memory[layers], layout, theirs, dst, sock, phases)
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
            self._send_whole(staging[:layout.total_nbytes], layout, theirs, dst, sock, phases)
        finally:
            self.pool.release(staging)
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]

    def _send_gathered(self, kv: PiecewiseKV, layout, dst, sock, phases) -> float:
        """KV in blocks as one canonical buffer; KV still being computed goes one operation per layer, each layer
        gathered once the engine wrote it (ordered on the GPU after the engine's event, no host wait for the
        kernels). Returns the seconds spent waiting for layers."""
        nbytes, waited = layout.total_nbytes, 0.0
        try:
            staging, pooled = self.pool.acquire(nbytes), True
        except PoolExhausted:
            staging, pooled = torch.empty(nbytes, dtype=torch.uint8, device=self.device), False
        try:
            if kv.gate is None:
                with phases.measure("serialize"):
                    _gather(kv.layers, staging, layout)
                works = _post([(dist.isend, staging[:nbytes])], dst)
            else:
                works, failed = [], None
                for i, layer in enumerate(kv.layers):
                    t0 = time.perf_counter()
                    try:
                        event = None if failed else kv.ready_event(i)
                    except Exception as e:  # the forward failed: still send every layer, so sends and receives pair
                        failed = e
                    waited += time.perf_counter() - t0
                    if not failed:
                        with _on_side(self.device):
                            if event is not None:
                                torch.cuda.current_stream().wait_event(event)
                            rows = _rows(_layer_bytes(staging, layout, i), layout, layout.layer_nbytes)
                            torch.cat(_flat([layer]), dim=0, out=rows)
                    works += _post([(dist.isend, _layer_bytes(staging, layout, i))], dst)
                if failed:
                    _await(works, self.device, sock, self.cfg.timeout_s)
                    raise TransferError(f"the KV was never computed: {failed}")
            self.gathered_bytes += nbytes
            with phases.measure("wire"):
                _await(works, self.device, sock, self.cfg.timeout_s)
        finally:
            if pooled:
                self.pool.release(staging)
        return waited

    def _send_whole(self, buffer, layout, theirs, dst, sock, phases) -> None:
        """A canonical buffer: one send, or one per segment when the receiver lands it in pieces."""
        ops = [(dist.isend, buffer)] if theirs is None else _ops(dist.isend, _whole(buffer, layout), theirs)
        with phases.measure("wire"):
            _p2p_all(ops, dst, sock, self.cfg.timeout_s)


class NcclReceiver(SocketReceiver):
    name = "nccl"
    lands_pieces = True

    def __init__(self, cfg=None):
        super().__init__(cfg)
        _attach(self)
        self.drained = self.scattered_bytes = 0
        self.direct_cuts = int(self.cfg.options.get("nccl_direct_cuts", 0))

    def lands_on(self, device) -> bool:
        return torch.device(device) == self.device

    @property
    def eager_bytes(self) -> int:
        on = str(self.cfg.options.get("nccl_eager", True)).lower() not in ("0", "false", "no", "off")
        return min(self.cfg.max_transfer_bytes, self.pool.capacity_bytes) if on else 0

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        _use(self.device)
        eager, nbytes, meta = header.get("eager") is True, layout.total_nbytes, header.get("meta") or {}
        theirs = header.get("pieces")
        if theirs is not None:
            if eager:
                raise frames.FrameError("an eager BEGIN cannot send pieces")
            theirs = valid_piece_tokens(theirs, layout.num_tokens)
        landing = None if eager or self.land is None else self.land(tid, layout)
        mine = landing.kv.check().layers if landing is not None else None
        whole = not eager and _cuts(mine, theirs, layout.num_tokens) > self.direct_cuts
        buf = None
        if landing is None or whole:
            try:
                buf = self.pool.acquire(nbytes)
            except PoolExhausted:
                if eager:
                    self._drain(sock, nbytes)
                if landing is None:
                    raise
                whole = False
        release = landing.release if landing is not None else (lambda: self.pool.release(buf))
        try:
            if not eager:
                idle_s = float(self.cfg.options.get("idle_s", IDLE_S))
                grant = {"rank": dist.get_rank(), "eager_bytes": self.eager_bytes, "eager_idle_s": idle_s / 2}
                if whole:
                    grant["whole"] = True
                elif mine is not None:
                    grant["pieces"] = [p.shape[0] for p in mine[0][0]]
                sock.sendall(frames.meta_frame(frames.GRANT, grant))
            peer, scatter_ms = 1 - dist.get_rank(), 0.0
            if whole and header.get("streamed") is True:
                self._receive_layers(buf, mine, layout, peer, sock)
            else:
                if whole or (mine is None and theirs is None):
                    ops = [(dist.irecv, buf[:nbytes])]
                else:
                    ops = _ops(dist.irecv, mine if mine is not None else _whole(buf, layout), theirs or [layout.num_tokens])
                _p2p_all(ops, peer, sock, self.cfg.timeout_s)
                if whole and mine is not None:
                    t0 = time.perf_counter()
                    _scatter(buf, mine, layout)
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
        """A streamed KV: one receive per layer, each layer scattered into its blocks as soon as it arrived
        (ordered on the GPU; on the CPU after all arrived)."""
        works = []
        for i in range(layout.num_layers):
            works += _post([(dist.irecv, _layer_bytes(buf, layout, i))], peer)
            if self.device.type == "cuda" and mine is not None:
                with _on_side(self.device):
                    works[-1].wait()
                _scatter(_layer_bytes(buf, layout, i), [mine[i]], layout, sync=False)
        _await(works, self.device, sock, self.cfg.timeout_s)
        if mine is not None and self.device.type != "cuda":
            _scatter(buf, mine, layout)
        elif mine is not None:
            _side_stream(self.device).synchronize()

    def _refused(self, sock, header, layout) -> None:
        if header.get("eager") is True and layout is not None and layout.total_nbytes <= self.eager_bytes:
            self._drain(sock, layout.total_nbytes)

    def _drain(self, sock, nbytes: int) -> None:
        """Take an eager send this receiver will not keep, so later sends and receives stay paired."""
        _use(self.device)
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _p2p(dist.irecv, scratch, 1 - dist.get_rank(), sock, self.cfg.timeout_s)
        self.drained += 1
