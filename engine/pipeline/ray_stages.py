"""Pipeline stages as Ray actors, each on the node of its bundle of a placement group (``pdserve deploy ray --pp N
--pp-spread`` makes the group, one bundle per stage, STRICT_SPREAD: a node each).

Stage 0 (the worker process, itself in bundle 0) joins the Ray cluster
(``RAY_ADDRESS``) and starts one actor per other stage in bundle k; the
actor runs the stage's command (``python -m engine.pipeline.stage``, as
``launch.Stages`` would locally) with ``--own-device`` (Ray gave the actor
its GPU) and its node's address, where the stage's hop receiver and KV
receiver listen; the plan and report sockets listen on stage 0's node
address. The actors belong to stage 0's process: when it exits Ray removes
them and their stages die with them (``PR_SET_PDEATHSIG``), so the
supervisor restarting the worker restarts the pipeline as a unit. To
``launch.Stages`` each actor stands as a process (``pid``, ``poll``,
``wait``, ``kill``, ``host``). The plan sockets carry no authentication:
the nodes of one Ray cluster are trusted with it, as with Ray itself."""
from __future__ import annotations

import os
import subprocess
import time

from .launch import PARENT


class StageActor:
    def __init__(self, cmd: list[str], env: dict):
        import ray

        from ..parallel.follower import die_with_parent

        self.host = ray.util.get_node_ip_address()
        cmd = [str(os.getpid()) if c == PARENT else c for c in cmd] + ["--own-device"]
        env = {**os.environ, **env, "PDSERVE_RAY_NODE_IP": self.host}
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(os.getppid()))

    def info(self) -> dict:
        return {"pid": self.proc.pid, "host": self.host}

    def poll(self):
        return self.proc.poll()


class RayStage:
    """A stage's actor, as ``launch.Stages`` sees a process."""

    def __init__(self, actor, timeout_s: float = 600.0):
        import ray

        self.ray, self.actor, self.returncode, self.checked = ray, actor, None, 0.0
        info = ray.get(actor.info.remote(), timeout=timeout_s)  # placed (its bundle's resources free) and started
        self.pid, self.host = info["pid"], info["host"]

    def poll(self):
        if self.returncode is None and time.monotonic() - self.checked > 0.5:  # (the watcher asks every 0.1 s)
            self.checked = time.monotonic()
            try:
                self.returncode = self.ray.get(self.actor.poll.remote(), timeout=10)
            except self.ray.exceptions.GetTimeoutError:
                return None
            except self.ray.exceptions.RayError:  # the actor (its node) is gone
                self.returncode = -9
        return self.returncode

    def wait(self, timeout: float):
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired("pipeline stage", timeout)
            time.sleep(0.1)
        return self.returncode

    def kill(self) -> None:
        self.ray.kill(self.actor)


def start_stages(group_name: str, cmds: dict[int, list], env: dict) -> dict[int, RayStage]:
    """Stage k's command in an actor in bundle k of the placement group ``group_name`` (``namespace/name``)."""
    import ray
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    namespace, _, name = group_name.rpartition("/")
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=namespace or None, logging_level="ERROR",
                 log_to_driver=False, configure_logging=False,
                 _node_ip_address=os.environ.get("PDSERVE_RAY_NODE_IP"))
    group = get_placement_group(name)
    bundles = group.bundle_specs
    actors = {}
    for stage, cmd in cmds.items():
        bundle = bundles[stage]
        actors[stage] = ray.remote(StageActor).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=stage),
        ).remote(cmd, env)
    return {stage: RayStage(actor) for stage, actor in actors.items()}
