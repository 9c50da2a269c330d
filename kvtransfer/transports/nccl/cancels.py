"""Cancelling an nccl push without losing its pair. Cutting a transfer's connection part-way aborts the pair (a
posted operation cannot be taken back, so the next KV between the two ends needs a new communicator), and the
prefill worker cancels every push whose request went away. So a cancelled push that has not sent its BEGIN yet
(waiting its turn behind other pushes: transfers go one at a time) is dropped when its turn comes, before
anything is posted; one already under way gets ``GRACE_S`` to finish (milliseconds; it fails by itself if the peer
hangs up) before its connection is cut, as a stalled receiver's is."""
from __future__ import annotations

import threading

from ...base import TransferError

GRACE_S = 2.0
CANCELLED = "cancelled before it began"


class Cancels:
    def __init__(self, cut):
        self.cut = cut  # cut(transfer_id): drop the transfer's connection
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self._local = threading.local()

    def cancel(self, transfer_id: str) -> None:
        """``transfer_id`` is being sent (or waits to be): dropped before its BEGIN, else cut after ``GRACE_S``."""
        with self._lock:
            self._ids.add(transfer_id)
        timer = threading.Timer(GRACE_S, self.cut, (transfer_id,))
        timer.daemon = True
        timer.start()

    def starting(self, transfer_id: str) -> None:
        """This thread sends ``transfer_id`` now (``check`` then knows which transfer it asks about)."""
        self._local.tid = transfer_id

    def check(self) -> None:
        """Just before BEGIN: raise if this thread's transfer was cancelled (nothing is posted yet)."""
        with self._lock:
            if getattr(self._local, "tid", None) in self._ids:
                raise TransferError(CANCELLED)

    def done(self, transfer_id: str) -> None:
        with self._lock:
            self._ids.discard(transfer_id)
