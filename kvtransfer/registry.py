"""Transports by name, imported lazily so a backend's dependency is needed only
when that backend is chosen."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from .base import KVReceiver, KVSender, TransportConfig


@dataclass(frozen=True)
class TransportSpec:
    module: str
    sender: str
    receiver: str
    install_hint: str = ""


TRANSPORTS: dict[str, TransportSpec] = {
    "tcp": TransportSpec("kvtransfer.transports.tcp", "TcpSender", "TcpReceiver"),
    "shm": TransportSpec("kvtransfer.transports.shm", "ShmSender", "ShmReceiver"),
    "pickle": TransportSpec("kvtransfer.transports.pickle_tcp", "PickleSender", "PickleReceiver"),
    "mlx": TransportSpec("kvtransfer.transports.mlx_dist", "MlxSender", "MlxReceiver", "pip install 'pdserve[mlx]' (mlx[cpu] on Linux)"),
    "nixl": TransportSpec("kvtransfer.transports.nixl_ucx", "NixlSender", "NixlReceiver",
                          "pip install --no-deps nixl nixl-cu12 (plain `nixl` pulls CUDA torch)"),
    "nccl": TransportSpec("kvtransfer.transports.nccl.transport", "NcclSender", "NcclReceiver", "a CUDA build of torch with NCCL"),
    "arrow": TransportSpec("kvtransfer.transports.arrow.flight", "ArrowSender", "ArrowReceiver", "pip install 'pdserve[arrow]'"),
    "ray": TransportSpec("kvtransfer.transports.ray_store", "RaySender", "RayReceiver", "pip install 'pdserve[ray]'"),
}


class TransportUnavailable(RuntimeError):
    pass


def names() -> list[str]:
    return sorted(TRANSPORTS)


def _load(name: str, attr: str):
    try:
        spec = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; choose one of {names()}") from None
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        hint = f"; install it with: {spec.install_hint}" if spec.install_hint else ""
        raise TransportUnavailable(f"transport {name!r} needs a missing dependency ({e.name}){hint}") from e
    return getattr(module, getattr(spec, attr))


def make_sender(name: str, cfg: TransportConfig | None = None) -> KVSender:
    return _load(name, "sender")(cfg or TransportConfig())


def make_receiver(name: str, cfg: TransportConfig | None = None) -> KVReceiver:
    return _load(name, "receiver")(cfg or TransportConfig())
