"""MLX distributed transport: ``mx.distributed`` send/recv between a prefill
rank and a decode rank. Backend ``jaccl`` is RDMA over Thunderbolt 5 on macOS;
``ring`` is TCP and runs anywhere (``mlx[cpu]`` on Linux).

MLX groups are a fixed world (hostfile + rank, read at init), so metadata
travels over the socket framing of ``sockets``: BEGIN, then the receiver,
holding its one-at-a-time data lock, answers GRANT ``{rank}`` and posts
``recv`` for each layer's K and V bytes while the sender ``send``s them;
END and ACK close the transfer. Data moves as uint8 so every dtype is
bit-exact. ``alloc`` hands out regions of one MLX array allocated once
(``mlx_pool_bytes``, on first use) that the producer writes through a torch
view, so such layers are sent as slices of it (a KV that fills one region in
the canonical order is checked once and its slices posted in one go); other
tensors are copied into new MLX arrays first (``staged_bytes``). Every MLX call of a process runs on one dedicated thread: MLX
streams and the ring's connections are not safe to drive from the many
connection threads of the socket layer. Options: ``mlx_backend`` (ring | jaccl | any), ``mlx_hostfile``,
``mlx_rank`` (else MLX's own ``MLX_HOSTFILE``/``MLX_RANK`` environment)."""
from __future__ import annotations

import os
import queue
import threading
import warnings
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import torch

from .. import frames
from ..arena import Arena
from ..base import ReceivedKV, TransferError
from ..sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from ..tensors import TORCH_DTYPES, check_layer, from_mlx, is_mlx, to_host

_group = None
_group_lock = threading.Lock()
_data_lock = threading.Lock()
_jobs: queue.Queue = queue.Queue()
DEFAULT_POOL_BYTES = 512 << 20


def _mlx_loop():
    while True:
        fn, args, future = _jobs.get()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)


def on_mlx_thread(fn, *args):
    """Run ``fn`` on the process's one MLX thread (a daemon: a recv stuck on a dead peer never blocks exit)."""
    future = Future()
    _jobs.put((fn, args, future))
    return future.result()


threading.Thread(target=_mlx_loop, name="mlx", daemon=True).start()


def group(cfg):
    global _group
    with _group_lock:
        if _group is None:
            opts = cfg.options
            if opts.get("mlx_hostfile"):
                os.environ["MLX_HOSTFILE"] = str(opts["mlx_hostfile"])
            if opts.get("mlx_rank") is not None:
                os.environ["MLX_RANK"] = str(opts["mlx_rank"])
            if not os.environ.get("MLX_HOSTFILE"):
                raise TransferError("mlx transport needs a hostfile (--mlx-hostfile or MLX_HOSTFILE) and a rank")
            _group = on_mlx_thread(lambda: mx.distributed.init(backend=opts.get("mlx_backend", "ring"), strict=True))
        return _group


class MlxSender(SocketSender):
    name = "mlx"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.group = group(self.cfg)
        self._slab = None
        self._slab_lock = threading.Lock()

    def _pool(self) -> Arena:
        with self._slab_lock:
            if self.owned is None:
                nbytes = int(self.cfg.options.get("mlx_pool_bytes", DEFAULT_POOL_BYTES))
                self._slab = on_mlx_thread(_slab, nbytes)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    self.owned = Arena(torch.from_numpy(np.asarray(self._slab)))
            return self.owned

    def alloc(self, layout, device="cpu"):
        return self._pool().source(layout) if device == "cpu" else None

    def _send_body(self, sock, layout, payload, phases) -> float:
        grant = read_grant(sock, {"rank": int})
        with _data_lock:
            if isinstance(payload, slice):
                return on_mlx_thread(self._send_placed, layout, payload.start, phases, grant["rank"])
            return on_mlx_thread(self._send_layers, layout, payload, phases, grant["rank"])

    def _send_placed(self, layout, start, phases, dst) -> float:
        n = layout.tensor_nbytes
        with phases.measure("wire"):
            try:
                mx.eval(send_in_order([self._slab[off:off + n] for off in range(start, start + layout.total_nbytes, n)],
                                      dst, self.group))
            except RuntimeError as e:
                raise TransferError(f"mlx send to rank {dst} failed: {e}") from e
        return (phases.d2h + phases.serialize) / 1e3

    def _arrays(self, k, v) -> list:
        arena = self.owned
        if arena is not None and arena.holds(k) and arena.holds(v):
            base, n = arena.memory.data_ptr(), k.numel() * k.element_size()
            return [self._slab[t.data_ptr() - base:t.data_ptr() - base + n] for t in (k, v)]
        self.staged_bytes += 2 * k.numel() * k.element_size()
        return [mx.array(t.reshape(-1).view(torch.uint8).numpy()) for t in (k, v)]

    def _send_layers(self, layout, layers, phases, dst) -> float:
        waited = [0.0]
        for _, (k, v), waited in timed_layers(layers, layout.num_layers):
            if is_mlx(k) and is_mlx(v):  # MLX arrays go as they are (their bytes, viewed)
                with phases.measure("serialize"):
                    check_layer(layout, from_mlx(k), from_mlx(v))
                    arrays = [mx.contiguous(a).view(mx.uint8).reshape(-1) for a in (k, v)]
            else:
                with phases.measure("d2h"):
                    k, v = to_host(k), to_host(v)
                with phases.measure("serialize"):
                    check_layer(layout, k, v)
                    arrays = self._arrays(k, v)
            with phases.measure("wire"):
                try:
                    mx.eval(send_in_order(arrays, dst, self.group))
                except RuntimeError as e:
                    raise TransferError(f"mlx send to rank {dst} failed: {e}") from e
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]


def send_in_order(arrays: list, dst: int, group):
    """Sends chained so they run in list order (MLX orders independent outputs as it likes)."""
    last = None
    for a in arrays:
        last = mx.distributed.send(a if last is None else mx.depends(a, last), dst, group=group)
    return last


def _slab(nbytes: int):
    slab = mx.zeros((nbytes,), dtype=mx.uint8)
    mx.eval(slab)
    return slab


class MlxReceiver(SocketReceiver):
    name = "mlx"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.group = group(self.cfg)

    def _recv_layers(self, layout, src) -> list:
        arrays = []
        for _ in range(layout.num_layers):
            k = mx.distributed.recv((layout.tensor_nbytes,), mx.uint8, src, group=self.group)
            v = mx.distributed.recv((layout.tensor_nbytes,), mx.uint8, src, group=self.group)
            pair = [k, mx.depends(v, k)]
            mx.eval(pair)
            arrays.append(pair)
        return arrays

    def _receive_body(self, sock, tid, layout, header, start) -> ReceivedKV:
        meta = header.get("meta") or {}
        src = 1 - self.group.rank() if self.group.size() == 2 else int(meta.get("rank", -1))
        if not 0 <= src < self.group.size():
            raise frames.FrameError("sender rank unknown")
        with _data_lock:
            sock.sendall(frames.meta_frame(frames.GRANT, {"rank": self.group.rank()}))
            try:
                arrays = on_mlx_thread(self._recv_layers, layout, src)
            except RuntimeError as e:
                raise ConnectionError(f"mlx recv from rank {src} failed: {e}") from e
        phases = self._finish(sock, layout, start)
        with phases.measure("deserialize"):
            dtype = TORCH_DTYPES[layout.dtype]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                layers = [tuple(torch.from_numpy(np.asarray(a)).view(dtype).view(layout.tensor_shape) for a in pair)
                          for pair in arrays]
        holder = {"arrays": arrays}
        return ReceivedKV(tid, layout, None, phases, holder.clear, meta, layers=layers)
