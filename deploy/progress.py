"""Progress of a long command (a bench run, ``pdserve up``'s start, checkpoint writing) through tqdm: on a terminal
one bar redrawn in place, in a log (not a terminal) a plain line at most every 10 seconds and one at the end."""
from __future__ import annotations

import sys

from tqdm import tqdm

tqdm.monitor_interval = 0  # no monitor thread: ``pdserve up`` forks its workers (deploy.forked) while a bar is open


def bar(total: int | None = None, desc: str = "", unit: str = "it", items=None) -> tqdm:
    """A bar to ``update`` by hand, or over ``items`` when given (iterate it)."""
    tty = sys.stderr.isatty()
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=tty, ascii=not tty,
                mininterval=0.2 if tty else 10.0, leave=True)
