"""Worker selection policies. ``pick(workers, prompt)`` gets the request's
``PromptKeys`` (or None); only ``kv_aware`` looks at it."""
from __future__ import annotations

import itertools


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, workers, prompt=None):
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding:
    def __init__(self):
        self._tie = itertools.count()

    def pick(self, workers, prompt=None):
        low = min(w.outstanding for w in workers)
        tied = [w for w in workers if w.outstanding == low]
        return tied[next(self._tie) % len(tied)]


def cached_blocks(worker, prompt) -> int:
    """How many leading blocks of the prompt ``worker`` reported holding (0 without an index or keys)."""
    if prompt is None:
        return 0
    keys = prompt.keys(int(worker.info.get("kv_block_size") or 0), str(worker.info.get("model") or ""))
    held = worker.kv_keys
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


class KVAware:
    """The worker holding the longest cached prefix of the prompt, balanced against load: score = cached share of
    the prompt - ``weight`` x outstanding / (1 + most outstanding); ties go to the least loaded."""

    def __init__(self, weight: float = 0.5):
        self.weight = weight
        self._tie = itertools.count()

    def pick(self, workers, prompt=None):
        if prompt is None or not prompt.ids:
            return LeastOutstanding.pick(self, workers)
        most = max(w.outstanding for w in workers)
        total = len(prompt.ids)

        scores = [cached_blocks(w, prompt) * int(w.info.get("kv_block_size") or 0) / total
                  - self.weight * w.outstanding / (1 + most) for w in workers]
        best = max(scores)
        return LeastOutstanding.pick(self, [w for w, s in zip(workers, scores) if s >= best - 1e-9])


def prompt_first(prefill_workers, decode_workers) -> set:
    """The decode workers to leave out of a disaggregated request's decode pick while another has room: the twin
    (a mixed worker is a client in both groups) of the one prefill worker with the fewest prompts in flight, where
    one has strictly fewest. The prefill pick comes after the decode pick and cannot use the decode worker itself, so
    without this the decode pick would choose where prompts go by accident: with two mixed workers, one slow at
    prompts decodes for longer, the least loaded decode pick goes to the other, and every prompt to the slow one."""
    loads = sorted(w.outstanding for w in prefill_workers)
    if len(loads) < 2 or loads[0] == loads[1]:
        return set()
    least = next(w for w in prefill_workers if w.outstanding == loads[0])
    return {d for d in decode_workers if d.address == least.address}


POLICIES = {"round_robin": RoundRobin, "least_outstanding": LeastOutstanding, "kv_aware": KVAware}


def make_policy(name: str, kv_weight: float = 0.5):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(kv_weight) if cls is KVAware else cls()
