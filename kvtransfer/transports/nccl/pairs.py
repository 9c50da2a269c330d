"""The nccl transport's process groups: one of two ranks per sender and receiver that talk (a "pair").

A sender meeting a receiver address for the first time (or after their pair
broke) starts a ``TCPStore`` on its own host and names it in the BEGIN
(``pair: "host:port"``); the receiver joins it, and both make a process group
of two over it (NCCL, or gloo with ``nccl_backend=gloo``): sender rank 0,
receiver rank 1. Later transfers between them reuse it. Groups are
independent of each other and of any ``torch.distributed`` default group (a
tensor-parallel engine's), so one process can send to several receivers
(each rank of a decode group) and receive from several senders. A transfer
lost mid-way aborts its pair only; the next transfer forms a new one."""
from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
# PyTorch's NCCL monitor polls each group's store for a "should dump" flag; a pair's store lives in the sender's
# process, so once a sender died (or exited first) it printed a failed store read every second. Transfers have
# their own timeouts (``ops.await_all``), which abort a pair that stops making progress.
os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
broken: list[str] = []  # why pairs were aborted, oldest first (reports and tests read it)


class Pair:
    def __init__(self, key: str, store, me: int, backend: str, device, timeout_s: float):
        self.key, self.store, self.me, self.peer = key, store, me, 1 - me
        self.backend, self.device, self.timeout = backend, device, timedelta(seconds=timeout_s)
        self.broken: str | None = None
        self._pg = None
        self._lock = threading.Lock()

    @property
    def pg(self):
        """The process group, made on first use (gloo's waits for the other end to make its own)."""
        with self._lock:
            if self._pg is None:
                if self.backend == "nccl":
                    # NCCL allocates a communicator's buffers with cudaMalloc, outside PyTorch's cache: give the
                    # cache's unused blocks back first (on a nearly full card its first operation failed otherwise)
                    torch.cuda.empty_cache()
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = self.timeout
                    self._pg = dist.ProcessGroupNCCL(self.store, self.me, 2, options)
                else:
                    self._pg = dist.ProcessGroupGloo(self.store, self.me, 2, self.timeout)
                log.info("nccl pair %s: %s group made as rank %d on %s", self.key, self.backend, self.me, self.device)
            return self._pg

    def abort(self, reason: str) -> None:
        if self.broken:
            return
        self.broken = reason
        broken.append(reason)
        log.error("aborting the nccl pair %s: %s", self.key, reason)
        try:
            if self._pg is not None and self.backend == "nccl":
                self._pg.abort()
        except Exception as e:  # noqa: BLE001 - a stuck operation stays stuck; the pair is dropped anyway
            log.warning("could not abort the pair's process group: %s", e)

    def close(self) -> None:
        """Shut the process group down, then let its store go: a group whose store went first has its NCCL
        watchdog print pages of failed store reads (``recvValue failed``, ``should dump``) as the process ends."""
        with self._lock:
            pg, self._pg = self._pg, None
        if pg is not None:
            try:
                stop = getattr(pg, "shutdown", None) if self.backend == "nccl" and not self.broken else None
                (stop or getattr(pg, "abort", lambda: None))()
            except Exception as e:  # noqa: BLE001 - closing anyway
                log.debug("nccl pair %s: shutdown: %s", self.key, e)
        self.store = None


class Pairs:
    """One end's pairs: ``for_dest`` (sender: by receiver address) and ``join`` (receiver: by the sender's store)."""

    def __init__(self, host: str, backend: str, device: torch.device, timeout_s: float):
        self.host, self.backend, self.device, self.timeout_s = host, backend, device, timeout_s
        self.by_key: dict[str, Pair] = {}
        self._lock = threading.Lock()

    @property
    def aborted(self) -> int:
        """Pairs this process aborted (workers report it: each costs the next transfer a new communicator)."""
        return len(broken)

    def close(self) -> None:
        """Every pair's group down before its store (the end's ``close``)."""
        with self._lock:
            pairs, self.by_key = list(self.by_key.values()), {}
        for pair in pairs:
            pair.close()

    def for_dest(self, dest: str) -> tuple[Pair, bool]:
        """``(pair, new)``: the live pair with the receiver at ``dest``, or a new one to announce in the BEGIN."""
        with self._lock:
            pair = self.by_key.get(dest)
            if pair is not None and not pair.broken:
                return pair, False
            if pair is not None:
                pair.close()
            store = dist.TCPStore(self.host, 0, 2, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.timeout_s))
            pair = Pair(f"{self.host}:{store.port}", store, 0, self.backend, self.device, self.timeout_s)
            self.by_key[dest] = pair
            log.info("nccl pair %s for the receiver at %s (store started)", pair.key, dest)
            return pair, True

    def join(self, key: str) -> Pair:
        """The pair a sender announced (``host:port`` of its store), joined on first sight. Broken pairs are
        closed here (their senders start a new store for the next transfer)."""
        with self._lock:
            gone = [k for k, p in self.by_key.items() if p.broken]
            for k in gone:
                self.by_key.pop(k).close()
            pair = self.by_key.get(key)
            if pair is None:
                host, _, port = key.rpartition(":")
                store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timedelta(seconds=self.timeout_s))
                pair = self.by_key[key] = Pair(key, store, 1, self.backend, self.device, self.timeout_s)
                log.info("nccl pair %s joined", key)
            return pair


class ClosesPairs:
    """(Mixed into either end) Closing the end closes its pairs first."""

    def close(self):
        pairs = getattr(self, "pairs", None)
        if pairs is not None:
            pairs.close()
        super().close()
