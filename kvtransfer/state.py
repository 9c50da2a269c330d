"""Receiver-side bookkeeping shared by transports: status per transfer id,
waiters, completion callbacks and lease expiry of unclaimed results."""
from __future__ import annotations

import logging
import threading
import time

from .base import ReceivedKV, TransferError, TransferStatus

log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("status", "result", "error", "deadline")

    def __init__(self, status, deadline):
        self.status = status
        self.result = None
        self.error = ""
        self.deadline = deadline


class TransferTable:
    def __init__(self, lease_s: float, on_change=None):
        self.lease_s = lease_s
        self.on_change = on_change
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}

    def _set(self, tid: str, status: TransferStatus, result=None, error: str = "") -> bool:
        with self._cond:
            entry = self._entries.get(tid)
            if entry is None:
                entry = self._entries[tid] = _Entry(status, time.monotonic() + self.lease_s)
            elif entry.status in (TransferStatus.ABORTED, TransferStatus.DONE, TransferStatus.FAILED) and status != TransferStatus.ABORTED:
                if result is not None:
                    result.release()
                return False
            entry.status = status
            entry.error = error or entry.error
            if result is not None:
                entry.result = result
            entry.deadline = time.monotonic() + self.lease_s
            self._cond.notify_all()
        if self.on_change and status != TransferStatus.RECEIVING:
            self.on_change(tid, status)
        return True

    def begin(self, tid: str) -> bool:
        with self._cond:
            entry = self._entries.get(tid)
            if entry is not None and entry.status != TransferStatus.PENDING:
                return False
        return self._set(tid, TransferStatus.RECEIVING)

    def done(self, tid: str, result: ReceivedKV) -> bool:
        result.completed_at = time.perf_counter()
        return self._set(tid, TransferStatus.DONE, result=result)

    def fail(self, tid: str, error: str) -> None:
        log.warning("transfer %s failed: %s", tid, error)
        self._set(tid, TransferStatus.FAILED, error=error)

    def abort(self, tid: str) -> None:
        with self._cond:
            entry = self._entries.get(tid)
            result = entry.result if entry else None
            if entry:
                entry.result = None
        if result is not None:
            result.release()
        self._set(tid, TransferStatus.ABORTED, error="aborted")

    def status(self, tid: str) -> TransferStatus:
        with self._cond:
            entry = self._entries.get(tid)
            return entry.status if entry else TransferStatus.PENDING

    def wait(self, tid: str, timeout: float | None) -> ReceivedKV:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                entry = self._entries.get(tid)
                if entry is not None and entry.status == TransferStatus.DONE:
                    del self._entries[tid]
                    return entry.result
                if entry is not None and entry.status in (TransferStatus.FAILED, TransferStatus.ABORTED):
                    del self._entries[tid]
                    raise TransferError(f"transfer {tid} {entry.status.value}: {entry.error}")
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"transfer {tid} not complete after {timeout:.1f}s")
                self._cond.wait(remaining if remaining is not None else 1.0)

    def expire(self) -> int:
        now = time.monotonic()
        expired = []
        with self._cond:
            for tid, entry in list(self._entries.items()):
                if entry.deadline < now and entry.status != TransferStatus.RECEIVING:
                    expired.append(entry)
                    del self._entries[tid]
        for entry in expired:
            if entry.result is not None:
                entry.result.release()
        return len(expired)

    def __len__(self):
        with self._cond:
            return len(self._entries)
