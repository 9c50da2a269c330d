"""Arrow Flight transport: what travels, and the cluster-token check.

The decode side runs a Flight server; prefill ``do_put``s the KV, in
``parts`` parallel streams (``arrow_streams``, 1 for KV still being
computed), every stream in flight on a gRPC connection of its own (the
sender checks an idle one out per stream). Each stream's descriptor command is a msgpack
header ``{v, tid, meta, part, parts}`` (wire version 3); stream ``part``
carries layers ``part, part + parts, ...`` in order. The schema has two
uint8 columns, ``k`` and ``v``, and the canonical layout (JSON of
``KVLayout.to_dict``: layers, heads, head size, tokens, dtype) in its
metadata under ``pdserve.layout``, so any Arrow reader can type the bytes;
each record batch carries one run of one layer's K bytes and the V bytes at
the same place (a whole layer, or one piece of a paged pool), as Arrow
arrays over the tensors' memory (no copy on the sender). Each batch's
application metadata is msgpack ``{layer, at, t, e, p}``: the layer, the
byte offset of the run in that layer's K (and V) tensor, the sender's
cumulative d2h, serialize and compute-wait milliseconds, the sender's
milliseconds since the transfer began when it wrote the batch (a float64, so
the size never changes; the receiver starts its record no later than any
batch's arrival minus this, taking in the call setup its handler's clock
misses), and padding that puts the batch's body on an aligned address in the
receiver's gRPC buffer. Runs must cover each layer exactly once, in order. A
layer that arrives whole and aligned is handed over as typed views of the
received Arrow buffers, with no copy; runs of a paged sender are copied once
into a pooled buffer, and a decode pool's blocks named by the ``land`` hook
take each run's one copy (``deserialize`` in the phases). After its last
batch a stream carries one metadata-only message, msgpack ``{e}`` (the same
clock, read once the last batch was handed to gRPC), which bounds the start
of the record the closest. Every stream is answered with one metadata
message, ``ok``, once all parts of its transfer have landed.

Auth: with a cluster token every call carries ``x-pdserve-auth:
<time>:<nonce>:<HMAC-SHA256(token, time:nonce)>``; a server middleware
refuses a missing or wrong MAC, one older than 60 s and a reused nonce (the
token itself never travels). TLS: ``arrow_tls_cert``/``arrow_tls_key`` on
the receiver, ``arrow_tls_root`` (the CA to trust) on the sender."""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import threading
import time

import msgpack
import pyarrow as pa
import pyarrow.flight as fl

VERSION = 3
MAX_STREAMS = 16
AUTH_HEADER = "x-pdserve-auth"
AUTH_WINDOW_S = 60.0
GRPC_OPTIONS = [("grpc.http2.lookahead_bytes", 64 << 20), ("grpc.http2.bdp_probe", 1)]
SCHEMA = pa.schema([("k", pa.uint8()), ("v", pa.uint8())])
LAYOUT_KEY = b"pdserve.layout"
FRAMING_BIAS = 15  # bytes before a batch's metadata and body in the receiver's buffer, modulo 16 (measured)


@functools.lru_cache(maxsize=64)
def _schema(layout_json: str) -> pa.Schema:
    return SCHEMA.with_metadata({LAYOUT_KEY: layout_json.encode()})


def schema_for(layout) -> pa.Schema:
    return _schema(json.dumps(layout.to_dict(), sort_keys=True))


def layout_dict(schema: pa.Schema) -> dict:
    """The layout a stream's schema declares; ``ValueError`` where it has none or not the two byte columns."""
    if schema is None or schema.remove_metadata() != SCHEMA:
        raise ValueError("schema is not two uint8 columns k and v")
    raw = (schema.metadata or {}).get(LAYOUT_KEY)
    if raw is None:
        raise ValueError("schema metadata has no pdserve.layout")
    return json.loads(raw)


def column(view) -> pa.Array:
    buf = pa.py_buffer(view)
    return pa.Array.from_buffers(pa.uint8(), len(buf), [None, buf])


def aligned(batch: pa.RecordBatch, itemsize: int) -> bool:
    return all((c.buffers()[1].address + c.offset) % itemsize == 0 for c in batch.columns)


def aligning_metadata(info: dict, run_bytes: int) -> bytes:
    """``info`` packed with a pad field sized so that the batch's body starts 16-byte aligned in the receiver's
    gRPC buffer (its offset there follows the FlightData fields before it: header, this metadata, the body's
    length), letting the receiver view the bytes as typed tensors without a copy. A receiver that finds a body
    unaligned anyway (other gRPC or Arrow framing) copies it."""
    body = 2 * (-(-run_bytes // 8) * 8)
    varint = 1 + (body.bit_length() - 1) // 7 if body else 1
    base = len(msgpack.packb({**info, "p": ""}))
    return msgpack.packb({**info, "p": "x" * ((-(base + varint + FRAMING_BIAS)) % 16)})


def auth_value(token: bytes) -> str:
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(12)
    mac = hmac.new(token, f"{stamp}:{nonce}".encode(), hashlib.sha256).hexdigest()
    return f"{stamp}:{nonce}:{mac}"


class AuthFactory(fl.ServerMiddlewareFactory):
    def __init__(self, token: bytes):
        self.token = token
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def start_call(self, info, headers):
        value = (headers.get(AUTH_HEADER) or [""])[0]
        parts = value.split(":")
        if len(parts) == 3:
            stamp, nonce, mac = parts
            want = hmac.new(self.token, f"{stamp}:{nonce}".encode(), hashlib.sha256).hexdigest()
            try:
                fresh = abs(time.time() - float(stamp)) < AUTH_WINDOW_S
            except ValueError:
                fresh = False
            if fresh and hmac.compare_digest(mac, want):
                with self.lock:
                    now = time.time()
                    self.seen = {n: t for n, t in self.seen.items() if now - t < 2 * AUTH_WINDOW_S}
                    if nonce not in self.seen:
                        self.seen[nonce] = now
                        return None
        raise fl.FlightUnauthenticatedError("pdserve cluster token required")


