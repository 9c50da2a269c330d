"""Where a request's prompt is prefilled: on a prefill worker (remote, its KV
then moves to the decode worker) or on the decode worker itself (local).

``always`` (the default) prefills every prompt remotely, ``never`` every one
locally (the decode workers then act as colocated replicas that a prefill
pool can still serve later), ``auto`` decides per request, in this order:

- the prompt's uncached part (its tokens less the prefix the decode worker
  reported holding) is at most ``local_tokens``: local (``short``): a short
  chunk costs the decode steps less than a transfer and a second queue;
  unless the decode worker serves a TPOT SLO (``--slo-tpot-ms``) that the
  step taking the chunk beside its decoding rows would break (``tpot_slo``,
  then weighed as a long prompt): the step's time is the worker's own fit of
  its mixed steps (``engine.step_budget``: ``fixed + per_token x chunk``),
  or, before it has one, its decode step plus the chunk at its prompt time
  a token. A worker whose mixed steps are slow (a prompt chunk beside a
  decode graph on a GPU) so keeps its rows within the SLO and leaves prompts
  to the prefill workers, while one whose mixed steps are cheap takes them;
- no prefill worker in the picks: local (``no_prefill_worker``);
- every prefill worker is busy and the decode worker's cost is lower:
  local (``prefill_busy``), else remote (``decode_busy``). Busy is a
  time: the uncached prompt tokens the router has in flight on the worker
  times that worker's prompt time a token (``prompt_ms_per_token`` of its
  ``step_times``: the median over its recent prompt steps, the first, cold
  one left out) is at least ``prefill_wait_ms``: the wait a prompt sent
  there now would have before its own prefill. The decode worker's cost is
  what prefilling there adds to everyone's time: its own local prompts'
  wait, plus the prompt's compute once for each sequence decoding there
  (every one of them waits for it): ``local_wait + rows x tokens x
  ms_per_token``, and, where the worker's fit of its mixed steps is known,
  what each of the prompt's chunks pays beyond a decode step (``fixed -
  base``) once for each row. A closed loop of clients is fastest when the sum of
  these waits is least, so a decode worker with few rows takes prompts
  from a short prefill queue while one decoding 28 rows leaves a 512-token
  prompt (16 ms there, 450 row-ms) to a prefill queue shorter than that
  (a rule by queue alone sent 75% of such prompts local at 32 streams and
  cost a third of the throughput; weighing only the first token where a
  worker's capped steps should keep its rows' SLO lost on 4x H200: the
  capped steps ran over it, bench/RESULTS.md). Until a worker has run two prompt steps
  (and with ``prefill_wait_ms`` 0) busy is a count: ``prefill_queue``
  prompts or more in flight, and then local only while the decode worker
  has fewer prompts of its own to prefill.
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
    local_ms: float | None = None  # what prefilling on the decode worker would cost (auto, where weighed)


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
        their first token; ``prefill_wait_ms()``: the wait behind them; ``prompt_ms_per_token()``, or None);
        ``decode_worker``: the one this request will decode on (``outstanding``: its requests; ``prompt_tokens_out``:
        its local prompts until their first token; its ``info["prefilling"]``: local prompts it has not finished)."""
        if self.mode == "always":
            return Decision("remote", "always")
        if self.mode == "never":
            return Decision("local", "never")
        breaks = _breaks_tpot(uncached_tokens, decode_worker)
        if uncached_tokens <= self.local_tokens and not breaks:
            return Decision("local", "short")
        if not prefill_workers:
            return Decision("local", "no_prefill_worker")
        remote = "tpot_slo" if uncached_tokens <= self.local_tokens else "long"  # why, when no busier reason
        queue = min(w.outstanding for w in prefill_workers)
        per_token = [w.prompt_ms_per_token() for w in prefill_workers]
        if not self.prefill_wait_ms or None in per_token:  # by count
            if queue >= self.prefill_queue and int(decode_worker.info.get("prefilling") or 0) < queue:
                return Decision("local", "prefill_busy")
            return Decision("remote", remote)
        wait = min(w.prefill_wait_ms() for w in prefill_workers)
        if wait < self.prefill_wait_ms:
            return Decision("remote", remote, wait)
        local = self.local_cost_ms(uncached_tokens, decode_worker, min(per_token))
        if wait > local:
            return Decision("local", "prefill_busy", wait, local)
        return Decision("remote", "decode_busy", wait, local)

    @staticmethod
    def local_cost_ms(uncached_tokens: int, decode_worker, fallback_per_token: float) -> float:
        """The waits a local prefill adds: the decode worker's own prompts ahead of it, and the prompt's compute (and
        each chunk's fixed cost beyond a decode step, where the worker fitted its mixed steps) once for each
        sequence decoding there."""
        per_token = decode_worker.prompt_ms_per_token() or fallback_per_token
        ahead = decode_worker.prefill_wait_ms(per_token) or 0.0
        rows = decoding_rows(decode_worker)
        info = decode_worker.info
        fixed, base = info.get("mixed_step_fixed_ms"), info.get("step_base_ms")
        overhead = 0.0
        if fixed is not None and base is not None:
            cap = info.get("step_prefill_cap") or uncached_tokens
            overhead = -(-uncached_tokens // max(1, cap)) * max(0.0, fixed - base)
        return ahead + rows * (uncached_tokens * per_token + overhead)


def decoding_rows(worker) -> int:
    """The sequences decoding on ``worker``: the router's requests there less its local prompts not yet started."""
    return max(worker.outstanding - len(worker.prompt_tokens_out), 0)


def mixed_step_ms(tokens: int, worker) -> float | None:
    """What ``worker``'s next step would take with a chunk of ``tokens`` prompt tokens (at most its cap) beside its
    decoding rows: its fit of its mixed steps, else its decode step plus the chunk at its prompt time a token;
    None while it has timed neither."""
    info = worker.info
    chunk = min(tokens, info.get("step_prefill_cap") or tokens)
    fixed, per_token = info.get("mixed_step_fixed_ms"), info.get("step_ms_per_prompt_token")
    if fixed is not None and per_token is not None:
        return fixed + per_token * chunk
    base, prompt_per_token = info.get("step_base_ms"), worker.prompt_ms_per_token()
    if base is None or prompt_per_token is None:
        return None
    return base + prompt_per_token * chunk


def _breaks_tpot(tokens: int, worker) -> bool:
    """Prefilling ``tokens`` on ``worker`` would make a step of its decoding rows longer than the TPOT SLO it
    serves (no SLO, no rows, or no times yet: it would not, as far as is known)."""
    slo = worker.info.get("slo_tpot_ms")
    if not slo or not decoding_rows(worker):
        return False
    step = mixed_step_ms(tokens, worker)
    return step is not None and step > slo
