"""MLX distributed transport: ``mx.distributed`` send/recv between a prefill
rank and a decode rank. Backend ``jaccl`` is RDMA over Thunderbolt 5 on macOS;
``ring`` is TCP and runs anywhere (``mlx[cpu]`` on Linux).

MLX groups are a fixed world (hostfile + rank, read at init), so metadata
travels over the socket framing of ``sockets``: BEGIN, then the receiver,
holding its one-at-a-time data lock, answers GRANT ``{rank}`` and posts
``recv`` for each layer's K and V bytes while the sender ``send``s them;
END and ACK close the transfer. Data moves as uint8 so every dtype is
bit-exact. Every MLX call of a process runs on one dedicated thread: MLX
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

from . import frames
from .base import ReceivedKV, TransferError
from .sockets import SocketReceiver, SocketSender, read_grant, timed_layers
from .tensors import TORCH_DTYPES, check_layer, to_host

_group = None
_group_lock = threading.Lock()
_data_lock = threading.Lock()
_send_lock = threading.Lock()
_jobs: queue.Queue = queue.Queue()


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

    def send(self, dest, transfer_id, layout, layers, meta=None):
        """One transfer at a time per process: concurrent MLX sends on one world can stall."""
        with _send_lock:
            return super().send(dest, transfer_id, layout, layers, meta)

    def _send_body(self, sock, layout, layers, phases) -> float:
        grant = read_grant(sock, {"rank": int})
        with _data_lock:
            return on_mlx_thread(self._send_layers, layout, layers, phases, grant["rank"])

    def _send_layers(self, layout, layers, phases, dst) -> float:
        waited = [0.0]
        for _, (k, v), waited in timed_layers(layers, layout.num_layers):
            with phases.measure("d2h"):
                k, v = to_host(k), to_host(v)
            with phases.measure("serialize"):
                check_layer(layout, k, v)
                arrays = [mx.array(t.reshape(-1).view(torch.uint8).numpy()) for t in (k, v)]
            with phases.measure("wire"):
                try:
                    mx.eval([mx.distributed.send(a, dst, group=self.group) for a in arrays])
                except RuntimeError as e:
                    raise TransferError(f"mlx send to rank {dst} failed: {e}") from e
        return (phases.d2h + phases.serialize) / 1e3 + waited[0]


class MlxReceiver(SocketReceiver):
    name = "mlx"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.group = group(self.cfg)

    def _recv_layers(self, layout, src) -> list:
        arrays = []
        for _ in range(layout.num_layers):
            pair = [mx.distributed.recv((layout.tensor_nbytes,), mx.uint8, src, group=self.group) for _ in range(2)]
            mx.eval(pair)
            arrays.append(pair)
        return arrays

    def _receive_body(self, sock, tid, layout, meta, start) -> ReceivedKV:
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
