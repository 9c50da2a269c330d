"""Start a tensor-parallel group from its rank 0 (the worker process) and watch it.

``start_group`` checks that ``--tp`` fits the model and the machine, starts
ranks 1..tp-1 as child processes (``python -m engine.parallel.follower``),
joins the ``torch.distributed`` group with them and returns rank 0's
``TPGroup`` with its ``PlanSender``. A watcher thread polls the children:
when one exits, ``group.on_lost(rank, code)`` runs (the worker fails its
requests then exits, so its supervisor restarts the group as a unit).
Followers die with rank 0 (``PR_SET_PDEATHSIG``, and they notice a new
parent within a second)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time

from ..config import EngineConfig
from .group import TPGroup, join
from .heads import check_tp
from .plan import PlanSender

log = logging.getLogger(__name__)


def model_heads(cfg: EngineConfig) -> tuple[int, int, int]:
    """``(attention heads, KV heads, MLP width)`` of the configured model, read without loading it."""
    from ..loader import TINY_NAME, _config
    from ..tiny import TINY_CONFIG

    if cfg.model == TINY_NAME and cfg.load_format != "dummy":
        c = TINY_CONFIG
        return c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    c = _config(cfg)
    heads = c.num_attention_heads
    return heads, getattr(c, "num_key_value_heads", None) or heads, c.intermediate_size


def check_fits(cfg: EngineConfig) -> None:
    heads, kv_heads, width = model_heads(cfg)
    check_tp(heads, kv_heads, cfg.tp)
    from ..factory import engine_kind

    if engine_kind(cfg) == "mlx" and kv_heads % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} on the mlx engine needs the {kv_heads} KV heads to split evenly (mlx-lm "
                         "does not replicate them); use the torch engine or a TP that divides them")
    if width % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} does not divide the MLP width {width}")


def held_store(timeout_s: float = 120.0):
    """Rank 0's rendezvous store, listening from now on on a port the OS picked (followers get its number: no
    port is named before it is bound, so no other process can take it in between)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def store_client(port: int, timeout_s: float = 120.0):
    """A client of the store ``held_store`` opened (in another process) on ``port``."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def start_group(cfg: EngineConfig, device, kv: tuple | None = None) -> TPGroup:
    """Rank 0 of a group of ``cfg.tp`` (the mlx engine: ``cfg.pp``, its pipeline's stages) on ``device``
    (``loader.rank_device`` of rank 0); blocks until all joined.
    ``kv``: ``(module:Class, environment)``: what the followers build to do their KV work (``follower.follow``)
    and the variables it reads (a transport's config, with the cluster token, stays off the command line)."""
    check_fits(cfg)
    from ..factory import engine_kind

    mlx = engine_kind(cfg) == "mlx"
    size = cfg.tp * (cfg.pp if mlx else 1)  # the mlx engine's pipeline stages are ranks of its group too
    if mlx:
        from .mlx_group import hostfile

        init = hostfile(size)
    else:
        store = held_store()
        init = f"tcp://127.0.0.1:{store.port}"
    plan = PlanSender(size - 1)
    config = json.dumps(dataclasses.asdict(cfg))
    procs = {}
    for rank in range(1, size):
        cmd = [sys.executable, "-m", "engine.parallel.follower", "--rank", str(rank), "--size", str(size),
               "--init", init, "--plan", plan.addresses[rank - 1], "--reports", plan.report_address,
               "--config", config, "--parent", str(os.getpid())] + (["--kv", kv[0]] if kv else [])
        procs[rank] = subprocess.Popen(cmd, env={**os.environ, **(kv[1] if kv else {})})
    group = TPGroup(size, 0, None, plan)
    group.procs = procs
    group.on_lost = _default_lost
    threading.Thread(target=_watch, args=(group,), name="tp-watch", daemon=True).start()
    if mlx:
        from .mlx_group import join as mlx_join

        group.group = mlx_join(init, 0)
        os.unlink(init)  # the ring is formed: every rank has read it
    else:
        group.group = join(cfg.tp, 0, init, device, store=store).group
    log.info("group of %d ranks up (ranks 1..%d: pids %s)", size, size - 1,
             [p.pid for p in procs.values()])
    return group


def _default_lost(rank: int, code: int) -> None:
    log.error("tensor-parallel rank %d exited (code %s): this worker exits too", rank, code)
    os._exit(70)


def _watch(group: TPGroup) -> None:
    while not getattr(group, "closing", False):
        for rank, proc in group.procs.items():
            code = proc.poll()
            if code is not None and not getattr(group, "closing", False):
                group.on_lost(rank, code)
                return
        time.sleep(0.2)


def stop_group(group: TPGroup, wait_s: float = 5.0) -> None:
    """Tell the followers to exit and reap them (killing what outlives ``wait_s``)."""
    procs = getattr(group, "procs", None)
    if not procs:
        return
    group.closing = True
    group.plan.close()
    deadline = time.monotonic() + wait_s
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    release_default_group()


def release_default_group(wait_s: float = 5.0) -> None:
    """Drop this process's default group once its peers are gone (gloo: destroyed). NCCL's is left to the
    process's exit: on two H100s ``destroy_process_group`` waited forever after the followers had exited, and an
    abort hung as well (a thread left in it ends the process with ``terminate``). A release that outlasts
    ``wait_s`` is left behind (logged) rather than hanging the worker's shutdown."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() == "nccl":
        return

    def release():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - shutting down: nothing is left to do with it
            log.warning("releasing the tensor-parallel process group failed: %s", e)

    thread = threading.Thread(target=release, name="release-group", daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        log.warning("the tensor-parallel process group did not release in %.0fs; left to the process's exit", wait_s)
