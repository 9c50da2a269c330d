"""A test hook: a request's messages dropped on purpose, so that the router's stall watchdog has a stall to notice
(``PDSERVE_TEST_MUTE``; ``tests/test_stall.py``)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class Muted:
    """A test hook (``PDSERVE_TEST_MUTE=MARKER[@N],...``): of each request whose prompt holds a MARKER, every message
    after the first N (default 0; ``progress`` not counted) is dropped, the engine otherwise untouched: a stall the
    router must notice."""

    def __init__(self, markers: dict | None = None):
        self.markers, self.left = markers or {}, {}

    @classmethod
    def from_env(cls) -> "Muted":
        spec = os.environ.get("PDSERVE_TEST_MUTE", "")
        pairs = [item.partition("@") for item in spec.split(",") if item]
        return cls({marker: int(after or 0) for marker, _, after in pairs})

    def consider(self, rid: str, msg: dict) -> None:
        if not self.markers or msg.get("op") not in ("generate", "prefill"):
            return
        prompt = str(msg.get("prompt") or msg.get("messages"))
        for marker, after in self.markers.items():
            if marker in prompt:
                log.warning("test hook: the messages of %s after its first %d are dropped", rid, after)
                self.left[rid] = after

    def drops(self, rid: str, op: str) -> bool:
        if rid not in self.left:
            return False
        if self.left[rid] <= 0 or op == "progress":
            return self.left[rid] <= 0
        self.left[rid] -= 1
        return False
