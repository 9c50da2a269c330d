"""A window of a worker's engine steps under the torch profiler, and where
each step's time went: ``PDSERVE_PROFILE_STEPS=START:COUNT`` profiles the
engine's steps START .. START+COUNT-1 (counted from 0 over the steps that
scheduled work; prefill and decode workers alike), and writes into
``PDSERVE_PROFILE_DIR`` (default: the temporary folder)
``{name}-{pid}-steps{START}-{END}.json``, a summary, and ``.trace.json.gz``, the
chrome trace (``chrome://tracing``, Perfetto).

The summary answers whether a step waited on the host or on the device:
per step its wall time (what ``step_times`` counts) and, on a GPU, the time
the device spent in kernels within it (the union of their intervals) and
how many ran; ``host_bound_share``, the part of the window's wall time with
no kernel running; the ops that took the most host time (self time) and the
kernels that took the most device time. Serving under load is when a
profile says most (the 1P1D prefill worker's steps ran at 30 us a token
where the engine alone runs 25); a window of 10-20 steps is a few MB.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

ENV_STEPS, ENV_DIR = "PDSERVE_PROFILE_STEPS", "PDSERVE_PROFILE_DIR"
STEP_NAME = "pdserve_step"
TOP = 15


def from_env(name: str) -> "StepProfiler | None":
    spec = os.environ.get(ENV_STEPS, "")
    if not spec:
        return None
    try:
        start, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_STEPS} must look like START:COUNT (e.g. 100:20), not {spec!r}") from None
    if start < 0 or count < 1:
        raise ValueError(f"{ENV_STEPS}: START must be >= 0 and COUNT >= 1 ({spec!r})")
    return StepProfiler(start, count, os.environ.get(ENV_DIR) or tempfile.gettempdir(), name)


class StepProfiler:
    def __init__(self, start: int, count: int, out_dir: str, name: str):
        self.start, self.count, self.out_dir, self.name = start, count, out_dir, name
        self.seen = 0  # steps that scheduled work so far
        self.walls: list[float] = []
        self.worked: list[bool] = []  # per marked step, in order: whether it scheduled work (the rest are left out)
        self.prof = self.step_range = None
        self.done = False

    def before(self) -> None:
        """Before a step: starts the profiler at the window's first step, and marks the step."""
        if self.done or self.seen < self.start:
            return
        if self.prof is None:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        from torch.profiler import record_function

        self.step_range = record_function(STEP_NAME)
        self.step_range.__enter__()

    def after(self, worked: bool, wall_ms: float) -> str | None:
        """After a step (``worked``: it scheduled something); returns the summary's path once the window ended."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
            self.worked.append(worked)
            if worked:
                self.walls.append(wall_ms)
        self.seen += worked
        if self.prof is None or self.done or len(self.walls) < self.count:
            return None
        return self.finish()

    def finish(self) -> str:
        self.prof.__exit__(None, None, None)
        self.done = True
        os.makedirs(self.out_dir, exist_ok=True)
        base = os.path.join(self.out_dir, f"{self.name}-{os.getpid()}-steps{self.start}-{self.start + self.count - 1}")
        summary = summarize(self.prof.events(), self.walls, self.worked)
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        plain = base + ".trace.json"
        self.prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(plain + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(plain)
        share = summary["host_bound_share"]
        log.warning("profiled steps %d-%d: %.1f ms, %s; %s", self.start, self.start + self.count - 1,
                    summary["wall_ms"], "no kernels" if share is None else f"no kernel running {100 * share:.0f}%",
                    base + ".json")
        return base + ".json"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def summarize(events, walls: list[float], worked: list[bool] | None = None) -> dict:
    """``events``: the profiler's (``profile.events()``); ``walls``: each profiled step's wall ms, in order;
    ``worked``: of each marked step, whether it did work (the others are left out; None: all did)."""
    from torch.autograd import DeviceType

    marked = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_NAME)
    steps = [r for r, w in zip(marked, worked or [True] * len(marked)) if w]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    rows, host, device = [], {}, {}
    for i, (a, b) in enumerate(steps):
        inside = [(max(a, k.time_range.start), min(b, k.time_range.end)) for k in kernels
                  if k.time_range.start < b and k.time_range.end > a]
        rows.append({"step": i, "wall_ms": round(walls[i] if i < len(walls) else (b - a) / 1e3, 3),
                     "profiled_ms": round((b - a) / 1e3, 3), "device_busy_ms": round(_union_ms(inside), 3),
                     "kernels": len(inside)})
    for e in events:
        if e.device_type == DeviceType.CUDA:
            device.setdefault(e.name, [0.0, 0])
            device[e.name][0] += (e.time_range.end - e.time_range.start) / 1e3
            device[e.name][1] += 1
        elif e.name != STEP_NAME:
            host.setdefault(e.name, [0.0, 0])
            host[e.name][0] += e.self_cpu_time_total / 1e3
            host[e.name][1] += 1
    wall = sum(r["profiled_ms"] for r in rows)
    busy = sum(r["device_busy_ms"] for r in rows)
    top = lambda d: [{"name": k, "ms": round(v[0], 3), "calls": v[1]}  # noqa: E731
                     for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:TOP]]
    return {"steps": rows, "wall_ms": round(wall, 3), "device_busy_ms": round(busy, 3),
            "host_bound_share": round(1 - busy / wall, 4) if wall and kernels else None,
            "top_host_self": top(host), "top_device": top(device)}


def attach(engine, role: str) -> None:
    """A window of ``engine``'s steps under the torch profiler, where ``PDSERVE_PROFILE_STEPS`` asks for one."""
    if hasattr(engine, "profiler"):
        engine.profiler = from_env(role)
