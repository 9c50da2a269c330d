"""The ``pdserve`` block's timing of a finished request: the phases of its KV transfer (the slowest rank's, each
rank's under ``kv_ranks``) and, for workers that run a pipeline (``--pp``), ``pp_hops``: per hop between stages
(``0->1``, ..., the last back to ``0``), the phases summed over the steps that carried this request (``steps``), for
the prefill worker's pipeline and the decode (or colocated) worker's. ``cached_tokens_by_tier``: the prompt's tokens
the worker that computed the KV in use took from its cache, by tier (``note_cached``)."""
from __future__ import annotations

import asyncio
import time

KV_SENT_GRACE_S = 2.0  # how long a finished stream waits for prefill's kv_sent (overlap/exposed)
PHASES = ("d2h", "serialize", "wire", "deserialize", "convert", "h2d")


def note_hops(run, role: str, timing) -> None:
    """Keep the ``pp_hops`` a worker reported (``first`` from prefill, ``done`` from decode or a colocated worker,
    whose hops cover its prompt too: the first's are then superseded)."""
    hops = timing.get("pp_hops") if isinstance(timing, dict) else None
    if not isinstance(hops, list) or len(hops) > 64:
        return
    held = run.timing.setdefault("_pp_hops", {})
    if role == "decode" and run.workers.get("prefill") is None:
        held.pop("prefill", None)  # one worker computed the prompt and decoded: its done covers both
        role = "colocated"
    held[role] = [hop_entry(i, len(hops), h) for i, h in enumerate(hops) if isinstance(h, dict)]


def note_cached(run, msg: dict) -> None:
    """What the worker that computed the prompt's KV took from its cache (``prefill.cached``): from its ``first``, or
    from the ``done`` of a prompt computed again without one (a local retry, a move whose source was lost)."""
    n = msg.get("cached_tokens")
    if type(n) is not int or n < 0:
        return
    tiers = msg.get("cached_tokens_by_tier")
    run.cached_tokens, run.cached_by_tier = n, tiers if isinstance(tiers, dict) else {"gpu": n}


def hop_entry(i: int, n: int, hop: dict) -> dict:
    out = {"hop": f"{i}->{(i + 1) % n}", "steps": int(hop.get("count", 0))}
    out.update({p: float(hop.get(p, 0.0)) for p in PHASES})
    out["total"] = sum(out[p] for p in PHASES)
    out["bytes"] = int(hop.get("bytes", 0))
    return out


def close_timing(run, metrics=None) -> dict:
    timing = run.timing
    timing["e2e"] = (time.perf_counter() - run.t0) * 1e3
    timing["retries"] = run.attempt
    if run.reasons:
        timing["retry_reasons"] = list(run.reasons)
    kv = timing.pop("kv", None) or {}
    timing.update({p: kv.get(p, 0.0) for p in PHASES})
    timing["transfer_total"] = kv.get("total", 0.0)
    timing["kv_bytes"] = kv.get("bytes", 0)
    if isinstance(kv.get("ranks"), list):  # a tensor-parallel decode group: the phases above are the slowest rank's
        timing["kv_ranks"] = [{p: r.get(p, 0.0) for p in ("wire", "h2d", "total", "bytes")} for r in kv["ranks"]
                              if isinstance(r, dict)]
    hops = timing.pop("_pp_hops", None)
    if hops:
        timing["pp_hops"] = [{"role": role, **h} for role, entries in hops.items() for h in entries]
        if metrics is not None:
            metrics.observe_hops(timing["pp_hops"])
    timing.setdefault("decode", 0.0)
    timing["cached_tokens_by_tier"] = run.cached_by_tier or {"gpu": run.cached_tokens or 0}
    if metrics is not None:
        metrics.observe_tiers(timing)
    return timing


def kv_sent(run, msg: dict, metrics=None) -> None:
    """Prefill's ``kv_sent``: how much of the KV's transfer its compute hid (``overlap``) and how much it left."""
    stream, timing = msg.get("stream"), run.timing
    if isinstance(stream, dict):
        timing.update({k: float(stream[k]) for k in ("overlap", "exposed") if isinstance(stream.get(k), (int, float))})
        timing["streamed"] = stream.get("streamed") is True
        if metrics is not None:
            metrics.observe_stream(timing["transport"], stream)


async def await_kv_sent(inbox, run, metrics=None) -> None:
    """The decode side can finish before prefill's ``kv_sent`` (sent after the receiver's ACK) arrives."""
    try:
        while "overlap" not in run.timing:
            msg = await asyncio.wait_for(inbox.get(), KV_SENT_GRACE_S)
            if msg.get("op") == "kv_sent":
                kv_sent(run, msg, metrics)
    except asyncio.TimeoutError:
        pass
