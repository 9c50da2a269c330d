"""A follower rank of a tensor-parallel group (started by ``launch.start_group``).

It builds the same engine as rank 0 (its shard of the model, its slice of
the KV pool, the same block count and CUDA graphs), then runs what rank 0's
plan says, step by step, until ``stop`` or rank 0 is gone."""
from __future__ import annotations

import argparse
import json
import faulthandler
import logging
import os
import signal
import sys

from control import lifetime

log = logging.getLogger("engine.parallel.follower")


def die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one exits (Linux); the plan loop also checks the parent."""
    lifetime.die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def child_setup(label: str, parent: int) -> None:
    """A child process of a worker (a rank, a stage): log lines named ``label``, die with ``parent``, and leave
    SIGINT/SIGTERM to it (it decides when its children stop)."""
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {label} %(name)s: %(message)s")
    die_with_parent(parent)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack on stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kv_work(spec: str | None, engine, plan):
    """The role's KV work for this process, built from ``module:Class`` (None without one)."""
    if not spec:
        return None
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(engine, plan)


def follow_step(engine, rows: list, copies: list, kv=None, ahead: bool = False) -> None:
    """Rank 0's step on this rank: its block copies, then the forward of its rows (``StepRow.to_wire``; those with
    a ``feed`` take rank 0's tokens of the step before); ``kv.take_progress()``: the layer gate of KV pushes
    streaming from this step, if any. ``ahead``: then take rank 0's tokens of this step."""
    from ..model_runner import StepRow

    for source, target in copies:
        engine.pool.copy_block(source, target)
    progress = kv.take_progress() if kv is not None else None
    rows = [StepRow(*r) for r in rows]
    feed = engine.shared_tokens if any(r.feed >= 0 for r in rows) else None
    try:
        engine.runner.run(rows, progress.layer_done if progress is not None else None, feed)
    except Exception as e:
        if progress is not None:
            progress.fail(e)
        raise
    if progress is not None:
        progress.finish()
    engine.shared_tokens = engine.group.share_tokens(None, sum(r.samples for r in rows), engine.device) if ahead \
        else None


def follow(engine, plan, parent: int, kv=None) -> None:
    """Run rank 0's plan on ``engine``: steps, KV work (``kv``: the role's handler of ``kv_*`` ops for this
    rank, e.g. ``prefill.tp_kv``), until ``stop``."""
    while True:
        msg = plan.recv(1000)
        if msg is None:
            if os.getppid() != parent:
                return
            continue
        op = msg["op"]
        if op == "stop":
            return
        if op == "step":
            follow_step(engine, msg["rows"], msg["copies"], kv, msg.get("ahead", False))
        elif op == "tier":
            engine.tiers.mirror.handle(msg)
        elif op.startswith("mlx_"):
            engine.follow(msg)
        elif kv is not None and op.startswith("kv_"):
            kv.handle(msg)
        else:
            log.warning("rank %d: unknown plan op %r", engine.group.rank, op)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.parallel.follower")
    for name in ("rank", "size", "parent"):
        ap.add_argument(f"--{name}", type=int, required=True)
    for name in ("init", "plan", "reports", "config"):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--kv", default=None, help="module:Class of this role's KV work for one rank (the worker's)")
    args = ap.parse_args(argv)
    child_setup(f"rank{args.rank}", args.parent)

    from ..config import EngineConfig
    from ..engine import Engine
    from ..loader import rank_device
    from .group import join
    from .plan import PlanReceiver

    cfg = EngineConfig(**json.loads(args.config))
    plan = PlanReceiver(args.plan, args.reports)
    from ..factory import engine_kind

    if engine_kind(cfg) == "mlx":
        from ..mlx.engine import MlxEngine
        from .group import TPGroup
        from .mlx_group import join as mlx_join

        group = TPGroup(args.size, args.rank, mlx_join(args.init, args.rank))
        engine = MlxEngine(cfg, group=group, plan_in=plan)
    else:
        device = rank_device(cfg.device, args.rank, args.size)
        group = join(args.size, args.rank, args.init, device)
        engine = Engine(cfg, group=group, device=device)
    follow(engine, plan, args.parent, kv_work(args.kv, engine, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
