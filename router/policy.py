"""Worker selection policies."""
from __future__ import annotations

import itertools


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, workers):
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding:
    def __init__(self):
        self._tie = itertools.count()

    def pick(self, workers):
        low = min(w.outstanding for w in workers)
        tied = [w for w in workers if w.outstanding == low]
        return tied[next(self._tie) % len(tied)]


POLICIES = {"round_robin": RoundRobin, "least_outstanding": LeastOutstanding}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
