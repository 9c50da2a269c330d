"""KV-cache transfer between prefill and decode: a canonical layout (``layout``), a small transport interface
(``base``), what the transports share (``frames``, ``sockets``, ``pieces``, ``pool``, ``arena``, ...), and the
transports themselves (``transports/``), loaded lazily by name (``registry``)."""
from .base import KVReceiver, KVSender, ReceivedKV, SourceKV, TransferError, TransferStatus, TransportConfig
from .layout import KVLayout, LayoutError
from .phases import PHASES, PhaseTimes
from .pieces import Landing, PiecewiseKV
from .pool_rows import PoolRows
from .registry import TransportUnavailable, make_receiver, make_sender, names

__all__ = [
    "KVLayout", "LayoutError", "KVReceiver", "KVSender", "ReceivedKV", "SourceKV", "TransferError", "TransferStatus",
    "TransportConfig", "PHASES", "PhaseTimes", "Landing", "PiecewiseKV", "PoolRows", "TransportUnavailable", "make_receiver", "make_sender", "names",
]
