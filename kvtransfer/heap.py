"""Keeping the memory a library receives into mapped, for transports whose
receive buffers come from ``malloc`` rather than from our pools (gRPC under
Arrow Flight). glibc serves blocks above its mmap threshold with fresh
``mmap``s and returns freed memory at the top of the heap to the system;
a multi-megabyte message then lands in pages that fault in one by one on
every transfer (about a third of the wire time on a 10 Gbit/s link, until
the dynamic threshold has grown). Fixing the threshold at its maximum and
keeping freed memory in the heap makes each transfer reuse the pages the
last one faulted in. Process-wide, glibc only, a no-op elsewhere."""
from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = (1 << 31) - 1
TOP_PAD = 64 << 20

_kept = False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep large freed blocks for reuse; True where that took effect (once per process)."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if ok:
        log.info("malloc keeps freed memory (mmap threshold %d MiB) so received buffers reuse mapped pages",
                 MMAP_THRESHOLD_MAX >> 20)
    _kept = ok
    return ok
