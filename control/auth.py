"""Cluster token: mutual challenge-response between the router and workers
(control plane) and between prefill and decode (data plane). The token never
crosses the wire; each side proves it holds it with an HMAC-SHA256 over both
sides' fresh nonces and a role label:

    client -> server   HELLO  {nonce: nc}
    server -> client   CHALLENGE {nonce: ns, proof: H(token, "server", nc, ns)}
    client -> server   AUTH   {proof: H(token, "client", ns, nc)}

The client checks the server's proof before answering, so neither side talks
to an impostor. A token is required when any role binds beyond loopback."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
NONCE_BYTES = 16


class AuthError(Exception):
    pass


def load_token(value: str | None = None, path: str | None = None) -> bytes | None:
    """The token from a flag value, a file, or the environment (in that order); None when unset."""
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if value is None and path:
        with open(path) as f:
            value = f.read().strip()
    if value is None:
        value = os.environ.get(TOKEN_ENV)
    if not value:
        return None
    if len(value) < 16:
        raise ValueError("the cluster token must be at least 16 characters")
    return value.encode()


def new_token() -> str:
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_token_for(host: str, token: bytes | None, role: str) -> None:
    if not token and not is_loopback(host):
        raise ValueError(f"{role} binds {host}, beyond loopback: set a cluster token "
                         f"(--cluster-token-file, or {TOKEN_ENV}) on every role")


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, label: str, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, label.encode() + b"|" + first + b"|" + second, hashlib.sha256).digest()


def verify(token: bytes, label: str, first: bytes, second: bytes, given) -> bool:
    return isinstance(given, bytes) and hmac.compare_digest(proof(token, label, first, second), given)


def valid_nonce(value) -> bool:
    return isinstance(value, bytes) and len(value) == NONCE_BYTES
