"""What ``/dashboard/state`` answers: the cluster now and the traffic of the last minute, from the router's own
state and its Prometheus registry (no second bookkeeping to drift from ``/metrics``).

Counters and histograms only grow, so each call keeps a sample of them (at most one a second, ``WINDOW_S`` of
them) and reports the difference between now and the oldest sample within the window: requests, errors and retries
per second, generated tokens per second, TTFT / TPOT / ITL p50 and p99 from the histograms' bucket counts (the
upper bound of the bucket the quantile falls in), KV bytes per second and the mean time of each transfer phase per
transport, the prefix cache's hit rate, the KV tiers' tokens and moves, and the disaggregation decisions by where
and why."""
from __future__ import annotations

import time
from collections import deque

from ..metrics import PHASE_NAMES

WINDOW_S = 60.0
LATENCIES = {"ttft_ms": "pdserve_ttft_seconds", "tpot_ms": "pdserve_tpot_seconds",
             "itl_ms": "pdserve_inter_token_latency_seconds"}
WORKER_FIELDS = ("engine", "device", "tp", "pp", "pid", "restarts", "active", "waiting", "queued", "kv_blocks",
                 "kv_blocks_free", "kv_reserved_bytes", "kv_budget_bytes", "role", "colocated")


def _families(registry) -> dict:
    """``{sample name: {labels tuple: value}}`` of every metric in the registry."""
    out: dict = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


class Window:
    """The samples of the last ``WINDOW_S`` seconds."""

    def __init__(self):
        self.samples: deque = deque()

    def add(self, registry) -> tuple[dict, dict, float]:
        """``(now's values, the oldest sample's within the window, seconds between them)``."""
        now = time.monotonic()
        values = _families(registry)
        if not self.samples or now - self.samples[-1][0] >= 1.0:
            self.samples.append((now, values))
        while len(self.samples) > 1 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()
        then, old = self.samples[0]
        return values, old, max(now - then, 1e-9)


def _delta(new: dict, old: dict, name: str, **match) -> float:
    """The growth of the samples of ``name`` whose labels include ``match``, summed."""
    def total(values):
        return sum(v for labels, v in values.get(name, {}).items() if all((k, w) in labels for k, w in match.items()))
    return max(0.0, total(new) - total(old))


def _quantiles(new: dict, old: dict, name: str) -> dict:
    """p50 and p99 (ms) of the observations of histogram ``name`` within the window, and their count."""
    buckets: dict[float, float] = {}
    for values, sign in ((new, 1), (old, -1)):
        for labels, v in values.get(name + "_bucket", {}).items():
            bound = float(dict(labels)["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sign * v
    ordered = sorted(buckets.items())
    count = ordered[-1][1] if ordered else 0.0
    out = {"count": int(count)}
    for q, key in ((0.5, "p50"), (0.99, "p99")):
        out[key] = next((b * 1e3 for b, c in ordered if count and c >= q * count), None)
        if out[key] == float("inf"):
            out[key] = ordered[-2][0] * 1e3 if len(ordered) > 1 else None  # past the last bound: at least that
    return out


def _transfers(new: dict, old: dict, seconds: float) -> dict:
    """Per transport: KV bytes per second and the mean ms of each phase of its transfers in the window."""
    out = {}
    transports = {dict(labels).get("transport") for labels in new.get("pdserve_kv_transfer_phase_seconds_count", {})}
    for t in sorted(x for x in transports if x):
        count = _delta(new, old, "pdserve_kv_transfer_phase_seconds_count", transport=t, phase="total")
        phases = {p: (_delta(new, old, "pdserve_kv_transfer_phase_seconds_sum", transport=t, phase=p) / count * 1e3
                      if count else 0.0) for p in PHASE_NAMES if p != "total"}
        out[t] = {"transfers": int(count), "bytes_per_s": _delta(new, old, "pdserve_kv_transfer_bytes_total",
                                                                 transport=t) / seconds, "phases_ms": phases}
    return out


def _tiers(new: dict, old: dict, seconds: float) -> dict:
    """Prompt tokens a second the workers took from the tiers below their GPU pools (``kvcache``), and the mean ms of
    the prefixes' moves out of them in the window: fetch (found and fetched) and load (copied into the GPU pool)."""
    count = {p: _delta(new, old, "pdserve_kv_tier_phase_seconds_count", phase=p) for p in ("fetch", "load")}
    return {"tokens_per_s": {t: _delta(new, old, f"pdserve_worker_prefix_tokens_from_{t}") / seconds
                             for t in ("host", "disk", "pool")},
            "phases_ms": {p: _delta(new, old, "pdserve_kv_tier_phase_seconds_sum", phase=p) / n * 1e3 if n else None
                          for p, n in count.items()},
            "moves": int(max(count.values()))}


def _disagg(new: dict, old: dict) -> list[dict]:
    rows = []
    for labels, _ in sorted(new.get("pdserve_disagg_requests_total", {}).items()):
        d = dict(labels)
        n = _delta(new, old, "pdserve_disagg_requests_total", **d)
        rows.append({**d, "in_window": int(n)})
    return rows


def _step_ms(times: dict) -> float | None:
    """A worker's mean step: its decode steps' where it decodes, else its prompt steps'."""
    return times.get("decode_step_ms_mean") if times.get("decode_steps") else times.get("prompt_step_ms_mean")


def worker_rows(groups: dict) -> list[dict]:
    rows = []
    for role, group in groups.items():
        for c in group.clients:
            info = c.info or {}
            rows.append({"role": info.get("role") or role, "group": role, "address": c.address, "healthy": c.healthy,
                         "outstanding": c.outstanding, "drain": c.drain_state,
                         "step_ms": _step_ms(info.get("step_times") or {}),
                         **{k: info.get(k) for k in WORKER_FIELDS if k != "role"}})
    return rows


def snapshot(st, window: Window) -> dict:
    st.metrics.observe_workers(st.groups)  # the workers' gauges as their last pongs said (else only /metrics sets them)
    new, old, seconds = window.add(st.metrics.registry)
    prompt = _delta(new, old, "pdserve_worker_prefix_prompt_tokens")
    cached = _delta(new, old, "pdserve_worker_prefix_tokens_saved")
    return {
        "time": time.time(), "mode": st.mode, "window_s": round(seconds, 1), "status": st.service.ready(),
        "workers": worker_rows(st.groups),
        "traffic": {
            "requests_total": int(sum(new.get("pdserve_requests_total", {}).values())),
            "requests_per_s": _delta(new, old, "pdserve_requests_total") / seconds,
            "errors_per_s": _delta(new, old, "pdserve_requests_total", outcome="error") / seconds,
            "retries_per_s": _delta(new, old, "pdserve_request_retries_total") / seconds,
            "tokens_per_s": _delta(new, old, "pdserve_generated_tokens_total") / seconds,
            "in_flight": int(sum(new.get("pdserve_requests_in_flight", {}).values())),
            "queued": st.admission.queued,
            **{key: _quantiles(new, old, name) for key, name in LATENCIES.items()},
        },
        "transfers": _transfers(new, old, seconds),
        "prefix_hit_rate": cached / prompt if prompt else None,
        "tiers": _tiers(new, old, seconds),
        "disagg": _disagg(new, old),
    }
