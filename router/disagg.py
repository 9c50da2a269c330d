"""Where a request's prompt is prefilled: on a prefill worker (remote, its KV
then moves to the decode worker) or on the decode worker itself (local).

``always`` (the default) prefills every prompt remotely, ``never`` every one
locally (the decode workers then act as colocated replicas that a prefill
pool can still serve later), ``auto`` decides per request, in this order:

- the prompt's uncached part (its tokens less the prefix the decode worker
  reported holding) is at most ``local_tokens``: local (``short``): a short
  chunk costs the decode steps less than a transfer and a second queue;
- no prefill worker in the picks: local (``no_prefill_worker``);
- every prefill worker is busy: local (``prefill_busy``), unless the decode
  worker has as many prompts of its own to prefill as the least busy
  prefill worker has in flight (then remote, ``long``). Busy is a time:
  the uncached prompt tokens the router has in flight on the worker times
  that worker's prompt time a token (``prompt_ms_per_token`` of its
  ``step_times``: the median over its recent prompt steps, the first, cold
  one left out) is at least ``prefill_wait_ms``: the wait a prompt sent
  there now would have before its own prefill. Until a worker has run two
  prompt steps (and with ``prefill_wait_ms`` 0) busy is a count:
  ``prefill_queue`` prompts or more in flight. (A count alone sent 70% of 512-token prompts local
  at 32 concurrent streams, where the prefill queue was ~4 prompts, ~0.1 s,
  and every local prompt stalled ~24 decoding rows.)
- otherwise remote (``long``).

Local prefill on a decode worker runs in chunks under that worker's
per-step prompt-token cap (``engine.step_budget``: ``--slo-tpot-ms`` or
``--step-prefill-tokens``), so it does not stretch the running sequences'
time per token past the SLO. A mixed worker (``--role mixed``) is in both groups: it is never its own
prefill worker (``same_worker`` when it is the only one in the picks). The
decision and its reason go into the
response's ``pdserve`` block and ``pdserve_disagg_requests``."""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("always", "never", "auto")


@dataclass(frozen=True)
class Decision:
    where: str  # "local" | "remote"
    reason: str
    wait_ms: float | None = None  # the least busy prefill worker's estimated wait (auto, where it was known)


@dataclass
class DisaggPolicy:
    mode: str = "always"
    local_tokens: int = 512
    prefill_queue: int = 4
    prefill_wait_ms: float = 500.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"disagg {self.mode!r} not in {MODES}")
        if self.local_tokens < 0 or self.prefill_queue < 1 or self.prefill_wait_ms < 0:
            raise ValueError("disagg_local_tokens and disagg_prefill_wait_ms must be >= 0 and "
                             "disagg_prefill_queue >= 1")

    def decide(self, uncached_tokens: int, prefill_workers: list, decode_worker) -> Decision:
        """``prefill_workers``: those in the picks (``outstanding``: prompts the router has in flight there, until
        their first token; ``prefill_wait_ms()``: the wait behind them, or None);
        ``decode_worker``: the one this request will decode on (its ``info["prefilling"]``: local prompts it has
        not finished)."""
        if self.mode == "always":
            return Decision("remote", "always")
        if self.mode == "never":
            return Decision("local", "never")
        if uncached_tokens <= self.local_tokens:
            return Decision("local", "short")
        if not prefill_workers:
            return Decision("local", "no_prefill_worker")
        queue = min(w.outstanding for w in prefill_workers)
        waits = [w.prefill_wait_ms() for w in prefill_workers]
        wait = min(waits) if self.prefill_wait_ms and None not in waits else None
        busy = wait >= self.prefill_wait_ms if wait is not None else queue >= self.prefill_queue
        if busy and int(decode_worker.info.get("prefilling") or 0) < queue:
            return Decision("local", "prefill_busy", wait)
        return Decision("remote", "long", wait)
