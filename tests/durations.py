"""The suite's modules, heaviest first (``tests/durations.json``: wall seconds a module took, summed over its tests).

With two pytest-xdist workers the suite ends when the later worker does; a long module collected last (collection
goes by file name) leaves the other worker idle for its length. ``conftest.py`` therefore orders the modules by these
seconds, the heaviest first, each module's tests kept together in their own order (its fixtures start once a worker).
Modules not in the file run last. Refresh it from a run with ``PDSERVE_TEST_CPU=FILE`` (``tests/conftest.py``):
``python -m tests.durations FILE``."""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")


def heaviest_first(items: list) -> None:
    """Sort pytest ``items`` in place by their module's recorded seconds, the heaviest first (stable)."""
    seconds = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


def record(path: str) -> dict:
    """Seconds a module from the JSON lines of a ``PDSERVE_TEST_CPU`` file, written to ``durations.json``."""
    seconds = collections.Counter()
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        seconds[row["test"].split("::", 1)[0]] += row["wall_s"]
    ordered = {module: round(s, 1) for module, s in seconds.most_common()}
    RECORD.write_text(json.dumps(ordered, indent=0) + "\n")
    return ordered


if __name__ == "__main__":
    print(f"{len(record(sys.argv[1]))} modules written to {RECORD}")
