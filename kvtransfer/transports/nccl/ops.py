"""The GPU side of the nccl transport: point-to-point operations between the
two ranks of a ``pairs.Pair`` (``"send"``/``"recv"``), posted on a
high-priority side stream and awaited while watching the control socket
(``await_all``: a peer that hangs up aborts the pair, since a posted
operation left behind would pair with the next transfer's; the waiting thread
naps between looks, longer as the wait grows (at most 1/20 of it, 1 ms), so a
long transfer does not take the GIL from the engine's thread twenty thousand
times a second), and the gather / scatter of KV pieces through one canonical
buffer (``as_rows``: the buffer as ``[layers * 2 * tokens, kv_heads,
head_dim]``; KV in a pool's rows, ``PoolRows``, is copied by index: one kernel
per layer and side however scattered its blocks)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from ...base import TransferError
from ...pieces import common_cuts, segments
from ...pool_rows import PoolRows
from ...sockets import peer_hung_up
from ...tensors import TORCH_DTYPES, unpack

log = logging.getLogger(__name__)
lock = threading.Lock()
SPIN_S, CHECK_S, POLL_S = 0.05, 0.001, 0.001  # spin 50 ms (looking at the socket every 1 ms), then poll
NAP_S, NAP_MAX_S = 50e-6, 1e-3  # between looks at the operations: 50 us, growing to 1/20 of the wait so far, 1 ms
side_streams: dict = {}


def use_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def p2p(op: str, tensor, pair, sock, timeout_s: float) -> None:
    p2p_all([(op, tensor)], pair, sock, timeout_s)


def p2p_all(ops: list, pair, sock, timeout_s: float) -> None:
    """Post ``("send"|"recv", tensor)`` operations (several as one NCCL group) and wait for them (``await_all``).
    An error of the backend (the peer's process exited while the communicator formed, say) aborts the pair and
    is raised as a one-line ``TransferError``: an expected failure, not a crash."""
    try:
        await_all(post(ops, pair), ops[0][1].device, sock, timeout_s, pair)
    except torch.distributed.DistBackendError as e:
        reason = str(e).strip().splitlines()[0][:300]
        pair.abort(reason)
        raise TransferError(f"nccl transfer lost: {reason}") from None


def post(ops: list, pair) -> list:
    if pair.broken:
        raise TransferError(f"nccl pair unusable ({pair.broken}); the next transfer forms a new one")
    pg, device = pair.pg, ops[0][1].device
    with on_side(device):
        grouped = len(ops) > 1 and device.type == "cuda"
        if grouped:
            pg._start_coalescing(device)
        works = [pg.send([t], pair.peer, 0) if op == "send" else pg.recv([t], pair.peer, 0) for op, t in ops]
        if grouped:
            return [pg._end_coalescing(device)]
        return works


def await_all(works: list, device, sock, timeout_s: float, pair) -> None:
    """Wait for posted operations, watching the control socket: a peer that hung up (or no progress in
    ``timeout_s``) leaves an operation NCCL can never complete, and every later one of the pair would be
    mismatched, so the pair is aborted (the next transfer forms a new one)."""
    on_gpu = device.type == "cuda"
    done = (lambda: all(w.is_completed() for w in works)) if on_gpu else waiter(works)
    start = time.perf_counter()
    next_check, deadline = start + CHECK_S, time.monotonic() + timeout_s
    while not done():
        now = time.perf_counter()
        if now < next_check:
            time.sleep(min(NAP_MAX_S, max(NAP_S, (now - start) / 20)))
            continue
        next_check = now + CHECK_S
        hung_up = peer_hung_up(sock, POLL_S if now - start > SPIN_S else 0)
        if hung_up or time.monotonic() > deadline:
            pair.abort("peer hung up mid-transfer" if hung_up else f"no progress in {timeout_s:.0f}s")
            raise TransferError(f"nccl transfer lost: {pair.broken}")
    if on_gpu:
        with on_side(device):
            for w in works:
                w.wait()


def on_side(device):
    return torch.cuda.stream(side_stream(device)) if device.type == "cuda" else contextlib.nullcontext()


def as_rows(buffer: torch.Tensor, layout, nbytes: int | None = None) -> torch.Tensor:
    """A canonical buffer (or ``nbytes`` of it) as ``[layers * 2 * tokens, kv_heads, head_dim]`` rows."""
    nbytes = layout.total_nbytes if nbytes is None else nbytes
    return buffer[:nbytes].view(TORCH_DTYPES[layout.dtype]).view(-1, *layout.tensor_shape[1:])


def flat_pieces(pieces: list) -> list:
    return [p for pair in pieces for side in pair for p in side]


def gather(pieces: list, buffer: torch.Tensor, layout) -> None:
    """``pieces``' layers copied into ``buffer`` (canonical bytes of them): by index from many ``PoolRows`` spans."""
    with on_side(buffer.device):
        if isinstance(pieces, PoolRows) and pieces.by_index:
            pieces.copy_out(lambda i: layer_rows(buffer, layout, i))
        else:
            torch.cat(flat_pieces(pieces), dim=0, out=as_rows(buffer, layout, len(pieces) * layout.layer_nbytes))


def scatter(buffer: torch.Tensor, pieces: list, layout, sync: bool = True) -> None:
    """``buffer`` (canonical bytes of ``pieces``' layers) copied into ``pieces`` (by index into ``PoolRows``)."""
    with on_side(buffer.device):
        if isinstance(pieces, PoolRows) and pieces.by_index:
            pieces.copy_in(lambda i: layer_rows(buffer, layout, i))
        else:
            dst = flat_pieces(pieces)
            rows = as_rows(buffer, layout, len(pieces) * layout.layer_nbytes)
            torch._foreach_copy_(dst, list(rows.split([p.shape[0] for p in dst])))
    if sync and buffer.is_cuda:
        side_stream(buffer.device).synchronize()


def layer_bytes(buffer: torch.Tensor, layout, i: int) -> torch.Tensor:
    return buffer[layout.layer_offset(i):layout.layer_offset(i) + layout.layer_nbytes]


def layer_rows(buffer: torch.Tensor, layout, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s K and V in a canonical buffer as ``[tokens, heads, dim * itemsize]`` bytes each."""
    tokens, heads, dim = layout.tensor_shape
    k = buffer[layout.layer_offset(i):layout.layer_offset(i) + layout.tensor_nbytes]
    v = buffer[layout.layer_offset(i) + layout.tensor_nbytes:layout.layer_offset(i) + layout.layer_nbytes]
    return tuple(t.view(tokens, heads, dim * layout.itemsize) for t in (k, v))


def count_cuts(mine: list | None, theirs: list[int] | None, tokens: int) -> int:
    return len(common_cuts([p.shape[0] for p in mine[0][0]] if mine else [tokens], theirs or [tokens]))


def side_stream(device):
    with lock:
        if device not in side_streams:
            side_streams[device] = torch.cuda.Stream(device, priority=-1)  # ahead of the engine's kernels
        return side_streams[device]


def waiter(works):
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


def segment_ops(op: str, mine: list, theirs: list[int]) -> list:
    """One ``op`` per segment that both ends' pieces agree on: per layer, K's segments then V's, as bytes.
    ``mine`` holds per layer ``(k_pieces, v_pieces)``; ``theirs`` the peer's piece sizes in tokens."""
    cuts = common_cuts([p.shape[0] for p in mine[0][0]], theirs)
    return [(op, seg.view(-1).view(torch.uint8)) for pair in mine for pieces in pair for seg in segments(pieces, cuts)]


def whole_pieces(buffer: torch.Tensor, layout) -> list:
    """A canonical buffer as pieces (one per layer and K/V)."""
    return [([k], [v]) for k, v in unpack(buffer, layout)]
