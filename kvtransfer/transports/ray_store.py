"""Ray object-store (Plasma) transport.

The receiver runs a small async ``Inbox`` actor pinned to its own node and
publishes its name as the address (``ray:<name>``). The sender takes each
layer's K and V as zero-copy numpy byte views and ``ray.put``s the list in
Ray's own two steps, timed apart: Ray's serializer (pickle protocol 5 with
out-of-band buffers: a small header that references the arrays, no copy of
data) is ``serialize``; the core worker writing the bytes into the object
store, the transport's first move of the data, counts as ``wire``. It then
hands the ObjectRef to the inbox. A thread on the receiver takes new
refs from the inbox and ``ray.get``s them: Ray's object manager pulls the
bytes to the receiver's node and the arrays are read in place (zero copy).
Ownership stays with the sender; the object is freed once the receiver
releases it. Connects to ``options["ray_address"]`` / ``RAY_ADDRESS`` or
starts a local Ray; token auth follows Ray's ``RAY_AUTH_*`` environment."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..base import KVSender, ReceivedKV, TransferError, TransportConfig
from ..layout import KVLayout
from ..phases import PhaseTimes
from ..sockets import TableReceiver, timed_layers
from ..tensors import TORCH_DTYPES, check_layer, to_host

log = logging.getLogger(__name__)
NAMESPACE = "pdserve"
PREFIX = "ray:"


def node_ip(cfg: TransportConfig) -> str:
    """Ray rewrites 127.0.0.1 to the machine's outward address; use another loopback address instead."""
    ip = cfg.options.get("ray_node_ip") or os.environ.get("PDSERVE_RAY_NODE_IP") or cfg.host
    return "127.0.0.2" if ip in ("127.0.0.1", "localhost") else ip


def connect(cfg: TransportConfig) -> None:
    """Join the cluster at ``ray_address``/``RAY_ADDRESS``, else start a private local one."""
    if not ray.is_initialized():
        address = cfg.options.get("ray_address") or os.environ.get("RAY_ADDRESS") or "local"
        kwargs = {"include_dashboard": False} if address == "local" else {}
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False,
                 configure_logging=False, _node_ip_address=node_ip(cfg), **kwargs)


@ray.remote(num_cpus=0, max_concurrency=64)
class Inbox:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.ready: list = []
        self.event = asyncio.Event()

    async def put(self, tid, layout, meta, boxed_ref, sender):
        declared = KVLayout.from_dict(layout).total_nbytes
        if declared > self.max_bytes:
            raise ValueError(f"declared {declared} bytes over limit {self.max_bytes}")
        self.ready.append((tid, layout, meta, boxed_ref, sender))
        self.event.set()

    async def take(self, timeout: float):
        if not self.ready:
            self.event.clear()
            try:
                await asyncio.wait_for(self.event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.ready = self.ready, []
        return out


class RaySender(KVSender):
    name = "ray"

    def __init__(self, cfg: TransportConfig | None = None):
        self.cfg = cfg or TransportConfig()
        connect(self.cfg)
        self._inboxes: dict[str, object] = {}

    def _inbox(self, dest: str):
        if not dest.startswith(PREFIX):
            raise TransferError(f"ray transport address must start with {PREFIX!r}, got {dest!r}")
        if dest not in self._inboxes:
            try:
                self._inboxes[dest] = ray.get_actor(dest[len(PREFIX):], namespace=NAMESPACE)
            except ValueError as e:
                raise TransferError(f"no ray receiver {dest}: {e}") from None
        return self._inboxes[dest]

    def send(self, dest, transfer_id, layout: KVLayout, layers, meta=None) -> PhaseTimes:
        inbox = self._inbox(dest)
        phases = PhaseTimes(bytes=layout.total_nbytes)
        try:
            arrays, keep = [], []
            for _, (k, v), _ in timed_layers(layers, layout.num_layers):
                with phases.measure("d2h"):
                    k, v = to_host(k), to_host(v)
                check_layer(layout, k, v)
                keep += [k, v]
                arrays += [k.reshape(-1).view(torch.uint8).numpy(), v.reshape(-1).view(torch.uint8).numpy()]
            ref = _put(arrays, phases)
            sender = {"d2h": phases.d2h, "serialize": phases.serialize, "wire": phases.wire}
            with phases.measure("wire"):
                ray.get(inbox.put.remote(transfer_id, layout.to_dict(), meta or {}, [ref], sender),
                        timeout=self.cfg.timeout_s)
        except (ValueError, ray.exceptions.RayError) as e:
            raise TransferError(f"transfer {transfer_id} to {dest} failed: {e}") from e
        return phases


class RayReceiver(TableReceiver):
    name = "ray"

    def __init__(self, cfg: TransportConfig | None = None):
        super().__init__(cfg)
        connect(self.cfg)
        self._name = f"pdserve-kv-{uuid.uuid4().hex[:12]}"
        self._inbox = None
        self._closing = False

    @property
    def address(self) -> str:
        return PREFIX + self._name

    def start(self) -> None:
        node = ray.get_runtime_context().get_node_id()
        self._inbox = Inbox.options(name=self._name, namespace=NAMESPACE, lifetime=None,
                                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                                        self.cfg.max_transfer_bytes)
        ray.get(self._inbox.take.remote(0))
        threading.Thread(target=self._loop, name="ray-kv-recv", daemon=True).start()

    def _loop(self):
        while not self._closing:
            try:
                batch = ray.get(self._inbox.take.remote(1.0))
            except ray.exceptions.RayError as e:
                if not self._closing:
                    log.error("ray inbox failed: %s", e)
                    time.sleep(1)
                continue
            for item in batch:
                self._receive(*item)
            self.table.expire()

    def _receive(self, tid, layout_dict, meta, boxed_ref, sender):
        try:
            layout = KVLayout.from_dict(layout_dict)
            if layout.total_nbytes > self.cfg.max_transfer_bytes:
                raise ValueError(f"declared {layout.total_nbytes} bytes over limit {self.cfg.max_transfer_bytes}")
        except ValueError as e:
            self.table.fail(tid, str(e))
            return
        if not self.table.begin(tid):
            return
        phases = PhaseTimes(d2h=float(sender.get("d2h", 0)), serialize=float(sender.get("serialize", 0)),
                            wire=float(sender.get("wire", 0)), bytes=layout.total_nbytes)
        try:
            with phases.measure("wire"):
                arrays = ray.get(boxed_ref[0], timeout=self.cfg.timeout_s)
            with phases.measure("deserialize"):
                layers = _views(arrays, layout)
        except (ray.exceptions.RayError, ValueError, TypeError) as e:
            self.table.fail(tid, f"object fetch failed: {e}")
            return
        holder = {"arrays": arrays, "ref": boxed_ref}
        self.table.done(tid, ReceivedKV(tid, layout, None, phases, holder.clear, meta, layers=layers))

    def close(self):
        self._closing = True
        if self._inbox is not None:
            ray.kill(self._inbox)


def _put(value, phases: PhaseTimes):
    """``ray.put`` as Ray does it, serializer and store write timed apart (whole ``ray.put``
    counted as serialize where this Ray lacks those internals)."""
    worker = ray._private.worker.global_worker
    if not hasattr(worker, "core_worker") or not hasattr(worker, "get_serialization_context"):
        with phases.measure("serialize"):
            return ray.put(value)
    with phases.measure("serialize"):
        serialized = worker.get_serialization_context().serialize(value)
    with phases.measure("wire"):
        return worker.core_worker.put_object(serialized, pin_object=True, inline_small_object=True,
                                             _is_experimental_channel=False, tensor_transport=None)


def _views(arrays, layout: KVLayout):
    if not isinstance(arrays, list) or len(arrays) != 2 * layout.num_layers:
        raise ValueError("object does not match the declared layout")
    dtype, out = TORCH_DTYPES[layout.dtype], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensors = [torch.from_numpy(a).view(dtype).view(layout.tensor_shape) for a in arrays]
    for i in range(layout.num_layers):
        out.append((tensors[2 * i], tensors[2 * i + 1]))
    return out
