"""Block hashes of the prefix cache: each full block of ``block_size`` token
ids is keyed by a hash chained over the block before it, so equal keys mean
equal prefixes. Salted with the model's name (workers serving other weights
never match). Pure Python: the router computes the same keys to route."""
from __future__ import annotations

import hashlib
from array import array


def block_hashes(token_ids, block_size: int, salt: str = "", limit: int | None = None) -> list[int]:
    """Keys of the full blocks of ``token_ids`` (at most ``limit`` of them), as 63-bit ints."""
    return extend_hashes([], token_ids, block_size, salt, limit)


def extend_hashes(keys: list[int], token_ids, block_size: int, salt: str = "", limit: int | None = None) -> list[int]:
    """``keys`` (those of the first blocks of ``token_ids``) extended to every full block (at most ``limit``)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    for i in range(len(keys), count):
        prev = keys[i - 1].to_bytes(8, "little") if i else salt.encode()
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        keys.append(int.from_bytes(h.digest(), "little") >> 1)
    return keys
