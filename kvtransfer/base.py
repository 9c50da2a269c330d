"""The transport interface every KV backend implements.

A transport is a pair: a ``KVSender`` on the prefill side and a ``KVReceiver``
on the decode side. The receiver owns destination buffers (taken from a pool
that is allocated/registered once and reused), exposes an ``address`` that the
router hands to prefill, and tracks each transfer by id:
``PENDING -> RECEIVING -> DONE | FAILED | ABORTED``. The sender pushes the KV
layer by layer (``layers`` may be a generator that yields while prefill still
computes), so transports can overlap transfer with compute.

A sender whose data must sit in memory it owns (registered with a NIC, an
MLX array, a GPU send buffer) offers that memory through ``alloc``: the
producer (the prefill engine's KV cache) writes each layer straight into the
returned ``SourceKV`` and ``send`` moves it from there without a staging
copy. Tensors from anywhere else are still accepted (and staged).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .layout import KVLayout
from .phases import PhaseTimes


class TransferError(RuntimeError):
    pass


class TransferStatus(str, enum.Enum):
    PENDING = "pending"
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass
class TransportConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_transfer_bytes: int = 8 << 30
    pool_bytes: int = 16 << 30
    timeout_s: float = 30.0
    lease_s: float = 60.0
    options: dict = field(default_factory=dict)
    token: bytes | None = None

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        for name in ("max_transfer_bytes", "pool_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("timeout_s and lease_s must be positive")

    def flag(self, name: str, default: bool) -> bool:
        """A yes/no option given as a bool or as text (1/0, true/false, yes/no, on/off)."""
        value = self.options.get(name, default)
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")


@dataclass
class ReceivedKV:
    """A completed transfer. ``buffer`` (canonical bytes) stays valid until
    ``release()`` (idempotent); a transport that hands over typed tensors
    instead (the pickle baseline) sets ``layers``."""

    transfer_id: str
    layout: KVLayout
    buffer: object
    phases: PhaseTimes
    on_release: Callable[[], None]
    meta: dict = field(default_factory=dict)
    released: bool = False
    layers: list | None = None
    completed_at: float = 0.0
    landed: object = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.on_release()


@dataclass
class SourceKV:
    """Sender-owned memory for one KV: ``layers`` are ``(k, v)`` views shaped
    ``layout.tensor_shape`` at ``offset`` of its ``owner``'s memory, in the
    canonical order; ``release()`` (idempotent) returns the memory. Passed to
    ``send`` itself (it iterates as its layers) it is sent without any checks."""

    layout: KVLayout
    layers: list
    on_release: Callable[[], None]
    owner: object = None
    offset: int = 0
    released: bool = False

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def fill(self, layers) -> "SourceKV":
        """Copy ``(k, v)`` tensors in (what a producer that did not write here itself does)."""
        for (k, v), (dk, dv) in zip(layers, self.layers, strict=True):
            dk.copy_(k)
            dv.copy_(v)
        return self

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.on_release()


class KVSender(ABC):
    name: str = "?"
    staged_bytes: int = 0
    sends_pieces: bool = False  # ``send`` also takes a ``PiecewiseKV`` (e.g. pool blocks, no copy)

    streams_layers = False  # a PiecewiseKV with a gate is sent layer by layer as each is computed
    one_at_a_time = False  # transfers go strictly one after another (a fixed world: nccl, mlx)

    def takes_pieces(self, device) -> bool:
        """Whether ``send`` moves a ``PiecewiseKV`` whose tensors live on ``device`` without copying it."""
        return self.sends_pieces and torch.device(device).type == "cpu"

    def alloc(self, layout: KVLayout, device: str = "cpu") -> SourceKV | None:
        """Memory on ``device`` that ``send`` can move without a copy, or None when this
        transport has none to offer (or none left)."""
        return None

    @abstractmethod
    def send(self, dest: str, transfer_id: str, layout: KVLayout, layers: Iterable, meta: dict | None = None) -> PhaseTimes:
        """Move ``layers`` (an iterable of ``(k, v)`` tensors) to the receiver at ``dest``."""

    def cancel(self, transfer_id: str) -> None:
        """Stop a ``send`` of ``transfer_id`` in flight, where the transport can (its ``send`` then raises
        ``TransferError`` at once instead of waiting out a dead link); otherwise nothing."""

    def close(self) -> None:
        pass


class KVReceiver(ABC):
    name: str = "?"

    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferStatus: ...

    @abstractmethod
    def wait(self, transfer_id: str, timeout: float | None = None) -> ReceivedKV:
        """Block until the transfer is DONE (returns it, caller must ``release``) or raise."""

    @abstractmethod
    def abort(self, transfer_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    on_complete: Callable[[str, TransferStatus], None] | None = None
    # ``land(transfer_id, layout) -> Landing | None``: memory to receive this transfer into (a receiver that
    # supports it sets ``lands_pieces``); the ReceivedKV then has ``landed`` set and no buffer
    land: Callable | None = None
    lands_pieces: bool = False

    def lands_on(self, device) -> bool:
        """Whether this receiver can land bytes in pieces of memory on ``device``."""
        return self.lands_pieces and torch.device(device).type == "cpu"
