"""The cluster-token handshake of ``control.auth`` over a data-plane socket
(HELLO, CHALLENGE, AUTH frames). Both functions raise ``FrameError`` when the
peer fails it; the caller drops the connection."""
from __future__ import annotations

import socket

from control import auth

from . import frames


def client_handshake(sock: socket.socket, token: bytes) -> None:
    nc = auth.nonce()
    sock.sendall(frames.meta_frame(frames.HELLO, {"nonce": nc}))
    kind, _, length = frames.parse_prefix(frames.recv_exact(sock, frames.PREFIX.size))
    reply = frames.read_meta(sock, length)
    if kind == frames.ACK:
        raise frames.FrameError(f"receiver refused the handshake: {reply.get('error')}")
    ns = reply.get("nonce")
    if kind != frames.CHALLENGE or not auth.valid_nonce(ns) or not auth.verify(token, "server", nc, ns, reply.get("proof")):
        raise frames.FrameError("receiver failed the cluster-token handshake (wrong token?)")
    sock.sendall(frames.meta_frame(frames.AUTH, {"proof": auth.proof(token, "client", ns, nc)}))


def server_handshake(sock: socket.socket, token: bytes) -> None:
    kind, _, length = frames.parse_prefix(frames.recv_exact(sock, frames.PREFIX.size))
    if kind != frames.HELLO:
        raise frames.FrameError("connection did not open with the cluster-token handshake")
    nc = frames.read_meta(sock, length).get("nonce")
    if not auth.valid_nonce(nc):
        raise frames.FrameError("HELLO without a valid nonce")
    ns = auth.nonce()
    sock.sendall(frames.meta_frame(frames.CHALLENGE, {"nonce": ns, "proof": auth.proof(token, "server", nc, ns)}))
    if not auth.verify(token, "client", ns, nc, frames.read_meta_frame(sock, frames.AUTH).get("proof")):
        raise frames.FrameError("sender failed the cluster-token handshake (wrong token?)")
