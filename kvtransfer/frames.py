"""Data-plane framing (wire version 4), used by socket transports.

Every frame starts with a fixed 20-byte prefix ``!4sHBBIQ``:
magic ``PDKV``, version, kind, flags, ``a`` (u32), ``b`` (u64).

    BEGIN  a=0      b=len(meta)  then msgpack {"tid", "layout", "meta"} (nccl: "eager")
    LAYER  a=layer  b=nbytes     then K bytes then V bytes of that layer
    END    a=0      b=len(meta)  then msgpack sender timings (ms)
    ACK    a=0 ok | 1 error, b=len(meta) then msgpack {"tid", "error"}
    GRANT  a=0      b=len(meta)  then msgpack, per transport (shm: where to write; nccl: rank and
                                 the eager limit; nixl: agent, memory, tag; mlx: rank)
    HELLO / CHALLENGE / AUTH     then msgpack {"nonce"} / {"nonce", "proof"} / {"proof"}

With a cluster token, a connection opens with HELLO, CHALLENGE, AUTH (the
handshake of ``control.auth``). A transfer is BEGIN, LAYER 0..n-1 in order,
END; the receiver answers ACK.
Lengths are checked against the declared layout and limits before anything is
read; a violation raises ``FrameError`` and the connection is dropped.
"""
from __future__ import annotations

import socket
import struct

import msgpack

MAGIC = b"PDKV"
WIRE_VERSION = 4
PREFIX = struct.Struct("!4sHBBIQ")
BEGIN, LAYER, END, ACK, GRANT, HELLO, CHALLENGE, AUTH = 1, 2, 3, 4, 5, 6, 7, 8
KINDS = {BEGIN, LAYER, END, ACK, GRANT, HELLO, CHALLENGE, AUTH}
MAX_META_BYTES = 64 * 1024


class FrameError(ValueError):
    pass


def prefix(kind: int, a: int = 0, b: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, WIRE_VERSION, kind, 0, a, b)


def meta_frame(kind: int, obj, a: int = 0) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return prefix(kind, a, len(body)) + body


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += r


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def parse_prefix(raw: bytes) -> tuple[int, int, int]:
    magic, version, kind, _flags, a, b = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != WIRE_VERSION:
        raise FrameError(f"wire version {version} != {WIRE_VERSION}")
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    return kind, a, b


def read_prefix(sock: socket.socket, expect: int | None = None) -> tuple[int, int]:
    kind, a, b = parse_prefix(recv_exact(sock, PREFIX.size))
    if expect is not None and kind != expect:
        raise FrameError(f"expected frame kind {expect}, got {kind}")
    return a, b


def read_meta_frame(sock: socket.socket, expect: int) -> dict:
    return read_meta(sock, read_prefix(sock, expect)[1])


def read_meta(sock: socket.socket, length: int) -> dict:
    if length > MAX_META_BYTES:
        raise FrameError(f"metadata length {length} over limit {MAX_META_BYTES}")
    try:
        obj = msgpack.unpackb(recv_exact(sock, length), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise FrameError(f"undecodable metadata: {e}") from None
    if not isinstance(obj, dict):
        raise FrameError("metadata is not a map")
    return obj
