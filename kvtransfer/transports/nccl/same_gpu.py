"""The nccl transport between two processes on one GPU, which NCCL cannot pair ("Duplicate GPU detected"): the
receiver copies the sender's buffer through a CUDA IPC mapping of it.

When a BEGIN names the receiver's own GPU (its UUID, ``gpu``), the receiver joins no pair and answers a GRANT with
``ipc: true`` and an eager limit of 0 (so every later transfer from that sender asks again). The sender puts the KV
in one canonical device buffer (its slab region as it is; pool blocks gathered, or layers joined, into a pooled
staging buffer: serialize), synchronizes, and sends a GRANT frame that exports the buffer's allocation
(``UntypedStorage._share_cuda_``: the IPC handle, sizes, offsets, the producer's reference counter). The receiver
opens it, copies the bytes into its landing blocks (or a pooled buffer), synchronizes, drops the mapping and sends
``{"copied": true}``; only then may the sender reuse the buffer. END and ACK follow as on every transfer. The copy
is the ``wire`` phase (device to device within the GPU). This is what a prefill TP group and a decode group that
share a GPU (heterogeneous TP on two GPUs) use for the pairs that NCCL refuses."""
from __future__ import annotations

import time

import torch

from ... import frames
from ...base import ReceivedKV
from .ops import gather, scatter, side_stream, sync_device, use_device
from ...pieces import PiecewiseKV
from ...pool import PoolExhausted
from ...sockets import read_grant

EXPORT = {"handle": bytes, "size": int, "offset": int, "counter": bytes, "counter_offset": int, "start": int,
          "nbytes": int}


def shares_gpu(header: dict, device: torch.device, gpu_id) -> bool:
    """Whether the BEGIN's sender is on this receiver's GPU (``gpu_id``: the UUID of a device)."""
    return device.type == "cuda" and header.get("gpu") == gpu_id(device)


def export(buffer: torch.Tensor) -> dict:
    """What another process on this GPU needs to map ``buffer`` (uint8, contiguous)."""
    _, handle, size, offset, counter, counter_offset, event, event_sync = buffer.untyped_storage()._share_cuda_()
    return {"handle": bytes(handle), "size": int(size), "offset": int(offset), "counter": bytes(counter),
            "counter_offset": int(counter_offset), "event": bytes(event or b""),
            "event_sync": bool(event_sync), "start": buffer.storage_offset(), "nbytes": buffer.numel()}


def mapped(note: dict, device: torch.device) -> torch.Tensor:
    """The exported buffer, mapped into this process (valid while the returned tensor lives). Every field is of the
    type ``_new_shared_cuda`` checks (the event handle bytes even when no event is to be waited for)."""
    torch.cuda._lazy_init()
    event_sync = bool(note.get("event_sync"))
    event = note.get("event") if isinstance(note.get("event"), bytes) and note.get("event") else bytes(64)
    storage = torch.UntypedStorage._new_shared_cuda(device.index, note["handle"], note["size"], note["offset"],
                                                    note["counter"], note["counter_offset"], event, event_sync)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, note["start"], (note["nbytes"],))


def send(tx, sock, layout, layers, phases) -> float:
    """The sender's side after an ``ipc`` GRANT; returns the seconds spent waiting for layers to be computed."""
    use_device(tx.device)
    nbytes, waited, staging, pooled = layout.total_nbytes, 0.0, None, False
    if isinstance(layers, slice):
        buffer = tx.owned.memory[layers]
        sync_device(tx.device)
    else:
        try:
            staging, pooled = tx.pool.acquire(nbytes), True
        except PoolExhausted:
            staging = torch.empty(nbytes, dtype=torch.uint8, device=tx.device)
        buffer = staging[:nbytes]
    try:
        if isinstance(layers, PiecewiseKV):
            kv = layers.check()
            t0 = time.perf_counter()
            for i in range(layout.num_layers):
                kv.ready(i)
            waited = time.perf_counter() - t0
            with phases.measure("serialize"):
                gather(kv.layers, buffer, layout)
                if buffer.is_cuda:
                    side_stream(tx.device).synchronize()
                tx.gathered_bytes += nbytes
        elif staging is not None:
            waited = tx.stage_layers(layers, layout, buffer, phases)
        with phases.measure("wire"):
            sock.sendall(frames.meta_frame(frames.GRANT, export(buffer)))
            read_grant(sock, {"copied": bool})
        tx.ipc_sends += 1
    finally:
        if pooled:
            tx.pool.release(staging)
    return (phases.d2h + phases.serialize) / 1e3 + waited


def receive(rx, sock, tid, layout, header, start) -> ReceivedKV:
    """The receiver's side of a BEGIN from a sender on this GPU."""
    if header.get("eager") is True:
        raise frames.FrameError("an eager BEGIN from a sender on this GPU (its GRANTs say ipc)")
    nbytes, meta = layout.total_nbytes, header.get("meta") or {}
    landing = rx.land(tid, layout) if rx.land is not None else None
    buf = rx.pool.acquire(nbytes) if landing is None else None
    release = landing.release if landing is not None else (lambda: rx.pool.release(buf))
    try:
        sock.sendall(frames.meta_frame(frames.GRANT, {"rank": 1, "eager_bytes": 0, "eager_idle_s": 0.0,
                                                      "ipc": True}))
        note = read_grant(sock, EXPORT)
        if note["nbytes"] != nbytes:
            raise frames.FrameError(f"an IPC buffer of {note['nbytes']} bytes for a KV of {nbytes}")
        source = mapped(note, rx.device)
        if landing is not None:
            scatter(source, landing.kv.check().layers, layout)
            rx.scattered_bytes += nbytes
        else:
            buf[:nbytes].copy_(source)
            sync_device(rx.device)
        del source
        sock.sendall(frames.meta_frame(frames.GRANT, {"copied": True}))
        phases = rx._finish(sock, layout, start, landed=time.perf_counter())
        rx.ipc_receives += 1
    except BaseException:
        release()
        raise
    if landing is not None:
        return ReceivedKV(tid, layout, None, phases, release, meta, landed=landing.kv)
    return ReceivedKV(tid, layout, buf[:nbytes], phases, release, meta)
