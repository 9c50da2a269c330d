"""Grammars compiled away from the engine thread.

A request whose guide is not compiled yet would make the engine thread wait
for xgrammar (on a worker's first guided request also for its import and the
vocabulary it reads: seconds), and with it every other request on the
worker. ``Background.ready(msg)`` answers at once: True when the message's
guide is compiled (or it has none), else False after handing the compile to
a thread of its own; once it is done the message goes back to the worker's
inbox (``resubmit``) and is handled again, its guide then in the cache (a
guide that does not compile is kept as its error, which the request gets as
a 400 like before). Where no guide can compile (xgrammar does not import),
every guided message is handled at once and gets that error. A request
aborted meanwhile is dropped when it comes back (``wanted``)."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from .grammars import engine_guides

log = logging.getLogger(__name__)


def guide_of(msg: dict):
    """The guide a ``generate``/``prefill``/``decode`` message asks for (a resumed request's in ``resume``)."""
    params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
    resume = msg.get("resume") if isinstance(msg.get("resume"), dict) else {}
    resumed = resume.get("params") if isinstance(resume.get("params"), dict) else {}
    return params.get("guide") or resumed.get("guide")


class Background:
    def __init__(self, engine, resubmit, wanted):
        self.engine, self.resubmit, self.wanted = engine, resubmit, wanted
        self.pool: ThreadPoolExecutor | None = None
        self.compiling: set[str] = set()
        self.unavailable = False  # no guide compiles on this worker: the requests get the error when handled

    def ready(self, msg: dict) -> bool:
        guide = guide_of(msg)
        if not isinstance(guide, dict):
            return True  # none, or a shape the request's own checks refuse
        guides = getattr(self.engine, "_guides", None)
        if self.unavailable or guides is not None and guides.has(guide):
            return True
        rid = msg["rid"]
        if rid not in self.compiling:
            self.compiling.add(rid)
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammars")
            self.pool.submit(self._compile, msg, guide)
        return False

    def _compile(self, msg: dict, guide: dict) -> None:
        try:
            engine_guides(self.engine).compile(guide, keep_errors=True)
        except Exception as e:  # kept in the cache: the request gets it when handled again
            log.info("guide of %s does not compile: %s", msg["rid"], e)
            self.unavailable = getattr(self.engine, "_guides", None) is None
        finally:
            self.compiling.discard(msg["rid"])
            if self.wanted(msg["rid"]):
                self.resubmit(msg)
