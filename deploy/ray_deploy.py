"""A pdserve cluster on Ray: ``pdserve deploy ray|status|scale|down``.

Every role is a detached, named actor in the namespace ``pdserve-<name>``
(``router``, ``prefill-<i>``, ``decode-<i>``) that owns one pdserve process
on its node (killed with the actor: it gets SIGKILL when its parent dies).
Actors are placed by Ray from their resources: ``--gpus-per-worker``, and
per role any custom resources (``--prefill-resources '{"pdserve-prefill":
0.01}'``; a node started with ``--resources`` or the built-in
``node:<ip>`` pins a role to kinds of hosts). Ray restarts a worker actor
that died (``--max-restarts``), and an actor whose process exited on its own
(a tensor-parallel rank died, say) dies with it, to be restarted; its new
process has a new address. A ``--tp N`` worker is one actor holding N GPUs
(``--gpus-per-worker`` each, in a STRICT_PACK placement group, so one node):
its process is rank 0 and starts the other ranks as its children, on the
GPUs Ray gave the actor, so the group is placed and restarted as a unit; so
is a ``--pp N`` worker's pipeline, unless ``--pp-spread`` puts each stage on
a node of its own (a STRICT_SPREAD placement group of a bundle per stage:
the actor is stage 0 and starts the others as actors in their bundles,
``engine.pipeline.ray_stages``). The
router actor keeps a workers file current from the named actors every
second, and the router re-reads it (``pdserve router --workers-file``): new
workers join, gone ones leave, nobody writes addresses by hand.

The cluster token (and the API key) reach the processes through the actors'
runtime environment (``PDSERVE_CLUSTER_TOKEN``/``PDSERVE_API_KEY``), never on
a command line. Without ``--address`` a local Ray cluster (token auth on) is
started for the deployment and stopped by ``down``. What later commands need
(Ray address, tokens, the local cluster's process groups) is kept in
``~/.pdserve/deployments/<name>.json``, readable by the owner only."""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

from control import lifetime
from control.listen import listen, port_of

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


def state_path(name: str) -> str:
    return os.path.join(os.path.expanduser("~"), ".pdserve", "deployments", f"{name}.json")


class Process:
    """An actor's pdserve process: ``python -m pdserve <role> --host <node ip> ...`` on a listening socket the actor
    binds (``port``, 0: any free one) and hands over (``control.listen``); a decode worker binds its KV port itself."""

    def __init__(self, role: str, argv: list[str], host: str | None = None, port: int = 0):
        import ray

        self.role, self.draining = role, False
        self.ip = host or ray.util.get_node_ip_address()
        if role != "router":
            from .ray_kv_pool import resolve

            argv = resolve(argv)  # --kv-pool mooncake: this node's daemon of the pool (deploy.ray_kv_pool)
        self.socket = listen(self.ip, port, "--port")
        self.port = port_of(self.socket)
        self.node = ray.get_runtime_context().get_node_id()
        flag = "--listen-fd" if role == "router" else "--control-fd"
        cmd = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", role, "--host", self.ip,
               flag, str(self.socket.fileno()), *argv]
        started = threading.Event()
        threading.Thread(target=self._run, args=(cmd, started), daemon=True).start()
        started.wait()

    def _run(self, cmd, started):
        """The process is started by, and dies with, this thread (which lives as long as the process)."""
        env = {**os.environ, "PDSERVE_RAY_NODE_IP": self.ip}  # the ray transport joins from this node
        self.proc = subprocess.Popen(cmd, preexec_fn=lifetime.die_with_parent, stdin=subprocess.DEVNULL, env=env,
                                     pass_fds=[self.socket.fileno()])
        started.set()
        code = self.proc.wait()
        if not self.draining:  # exited on its own: the actor goes too, so Ray restarts the whole worker
            os._exit(code or 1)

    def address(self) -> str:
        return f"http://{self.ip}:{self.port}" if self.role == "router" else f"tcp://{self.ip}:{self.port}"

    def describe(self) -> dict:
        return {"role": self.role, "address": self.address(), "node": self.node, "node_ip": self.ip,
                "pid": os.getpid(), "process": self.proc.pid, "alive": self.proc.poll() is None}

    def drain(self, timeout: float = 60.0) -> int | None:
        """SIGTERM: the process finishes what it has (graceful shutdown), then exits."""
        self.draining = True
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


class RouterProcess(Process):
    """The router, and the thread that keeps its workers file current from the deployment's named actors."""

    def __init__(self, argv: list[str], host: str | None, port: int):
        fd, self.file = tempfile.mkstemp(prefix="pdserve-workers-", suffix=".json")
        os.close(fd)
        self._write(self._members())
        super().__init__("router", ["--workers-file", self.file, *argv], host, port)
        threading.Thread(target=self._refresh, daemon=True).start()

    @staticmethod
    def _members() -> dict:
        import ray

        out = {role: [] for role in ROLES}
        for name in sorted(ray.util.list_named_actors()):
            role = name.split("-")[0]
            if role in out:
                try:
                    out[role].append(ray.get(ray.get_actor(name).address.remote(), timeout=2))
                except Exception:  # restarting or gone: left out until it answers again
                    pass
        return out

    def _write(self, members: dict) -> None:
        tmp = self.file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(members, f)
        os.replace(tmp, self.file)

    def _refresh(self):
        try:
            while self.proc.poll() is None:
                time.sleep(1.0)
                try:
                    self._write(self._members())
                except Exception as e:  # Ray busy or restarting: the router keeps the last list meanwhile
                    log.warning("workers file not refreshed: %s", e)
        finally:
            os.unlink(self.file)  # the router is gone: nobody reads it again


def _actor(cls, name: str, namespace: str, env: dict, max_restarts: int, gpus: float = 0, resources=None,
           ranks: int = 1, spread: int = 0):
    """``ranks`` > 1 with GPUs: the actor holds ``ranks * gpus`` GPUs of one node (a STRICT_PACK placement group).
    ``spread``: a pipeline of that many stages, one per node: a STRICT_SPREAD placement group of a bundle per stage
    (``gpus`` each), the actor in bundle 0 (stage 0, which starts the others in theirs: ``pipeline.ray_stages``)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    extra, cpus = {}, 0
    if spread > 1:
        base = {"GPU": gpus} if gpus else {"CPU": 0.01}
        cpus = base.get("CPU", 0)
        group = placement_group([{**base, **(resources or {})}] + [base] * (spread - 1), strategy="STRICT_SPREAD",
                                lifetime="detached", name=f"{namespace}-{name}")
        extra["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    elif ranks > 1 and gpus:
        group = placement_group([{"GPU": gpus * ranks}], strategy="STRICT_PACK", lifetime="detached",
                                name=f"{namespace}-{name}")
        extra["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return ray.remote(cls).options(name=name, namespace=namespace, lifetime="detached", num_cpus=cpus,
                                   num_gpus=gpus * ranks, resources=resources or None, max_restarts=max_restarts,
                                   max_concurrency=4, runtime_env={"env_vars": env}, **extra)


def _connect(state: dict):
    os.environ.update(state.get("ray_env") or {})  # before ray is imported: it reads its auth settings then
    import ray

    if not ray.is_initialized():
        ray.init(address=state["address"], namespace=state["namespace"], logging_level="ERROR",
                 _node_ip_address=state.get("node_ip"))
    return ray


def _load(name: str) -> dict:
    try:
        with open(state_path(name)) as f:
            return json.load(f)
    except OSError:
        raise SystemExit(f"pdserve deploy: no deployment named {name!r} ({state_path(name)} is missing)") from None


def _save(name: str, state: dict) -> None:
    path = state_path(name)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)


def _add_workers(ray, state: dict, role: str, count: int) -> None:
    existing = [n for n in ray.util.list_named_actors() if n.startswith(role + "-")]
    used = {int(n.split("-")[1]) for n in existing}
    index = 0
    for _ in range(count):
        while index in used:
            index += 1
        used.add(index)
        resources, name, spread = state["resources"].get(role), f"{role}-{index}", state.get("pp_spread", 0)
        argv = state["worker_args"] + (["--pp-placement-group", f"{state['namespace']}/{state['namespace']}-{name}"]
                                       if spread else [])
        _actor(Process, name, state["namespace"], state["env"], state["max_restarts"], state["gpus_per_worker"],
               resources, 1 if spread else state.get("tp", 1), spread).remote(role, argv)


def deploy_ray(args) -> int:
    from control.auth import load_token

    name, env = args.name, {}
    token = load_token(path=args.cluster_token_file)
    env["PDSERVE_CLUSTER_TOKEN"] = token.decode() if token else secrets.token_urlsafe(32)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            env["PDSERVE_API_KEY"] = f.read().strip()
    state = {"name": name, "namespace": f"pdserve-{name}", "env": env, "max_restarts": args.max_restarts,
             "gpus_per_worker": args.gpus_per_worker, "worker_args": args.worker_args,
             "tp": args.tp * getattr(args, "pp", 1),  # the processes (GPUs) of one worker: its ranks or stages
             "pp_spread": args.pp if getattr(args, "pp_spread", False) and args.pp > 1 else 0,
             "resources": {role: json.loads(getattr(args, f"{role}_resources") or "{}") for role in ROLES}}
    if args.address:
        state.update(address=args.address, ray_env={k: os.environ[k] for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")
                                                     if k in os.environ})
    else:
        from .raycluster import RayCluster

        cluster = RayCluster(num_cpus=max(2, os.cpu_count() or 2)).start()
        state.update(address=cluster.address, node_ip=cluster.head_ip, local_groups=[p.pid for p in cluster.procs],
                     ray_env={k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"})
    env.update(state["ray_env"], RAY_ADDRESS=state["address"])  # for the ray transport in the workers
    _save(name, state)
    ray = _connect(state)
    for role in ROLES:
        _add_workers(ray, state, role, getattr(args, role))
    router = _actor(RouterProcess, "router", state["namespace"], env, args.max_restarts).remote(
        args.router_args, args.host, args.port)
    url = ray.get(router.address.remote(), timeout=120)
    state["url"] = url
    _save(name, state)
    print(f"pdserve deployment {name!r} on Ray {state['address']}: {url}", flush=True)
    return 0


def describe(ray) -> list[dict]:
    from ray._private.state import actors  # the GCS actor table (the state API needs the dashboard)

    namespace = ray.get_runtime_context().namespace
    restarts = {a["Name"]: a["NumRestarts"] for a in actors().values()
                if a.get("Name") and a.get("State") != "DEAD" and a.get("RayNamespace", namespace) == namespace}
    out = []
    for name in sorted(ray.util.list_named_actors()):
        try:
            info = ray.get(ray.get_actor(name).describe.remote(), timeout=5)
        except Exception as e:
            info = {"role": name.split("-")[0], "alive": False, "error": type(e).__name__}
        out.append({"name": name, **info, "restarts": int(restarts.get(name, 0) or 0)})
    return out


def status(args) -> int:
    state = _load(args.name)
    rows = describe(_connect(state))
    if args.json:
        print(json.dumps({"url": state.get("url"), "actors": rows}))
        return 0
    print(f"deployment {args.name!r}: {state.get('url')} (Ray {state['address']})")
    for r in rows:
        print(f"  {r['name']:<12} {r.get('address', '-'):<28} node {r.get('node_ip', '-'):<15} "
              f"{'up' if r.get('alive') else 'down':<5} restarts {r['restarts']}")
    return 0


def scale(args) -> int:
    state = _load(args.name)
    ray = _connect(state)
    for role in ROLES:
        want = getattr(args, role)
        if want is None:
            continue
        names = sorted((n for n in ray.util.list_named_actors() if n.startswith(role + "-")),
                       key=lambda n: int(n.split("-")[1]))
        if want > len(names):
            _add_workers(ray, state, role, want - len(names))
        for name in names[want:][::-1]:  # drained first (no request dropped), then removed
            actor = ray.get_actor(name)
            _router_drain(state, ray.get(actor.describe.remote(), timeout=10).get("address"))
            ray.get(actor.drain.remote(), timeout=120)
            ray.kill(actor, no_restart=True)
            _remove_groups(state["namespace"] + "-" + name, exact=True)
    return 0


def _router_drain(state: dict, address: str | None) -> None:
    """The router moves what decodes on ``address`` to the other workers (``router.drain``) before it goes; the
    worker's own drain then waits for whatever could not move."""
    from .drain import drain

    if not state.get("url") or not address:
        return
    try:
        status, answer = drain(state["url"], address, state["env"].get("PDSERVE_API_KEY"), wait_s=120)
    except OSError as e:
        status, answer = 0, {"error": str(e)}
    if status != 200 or answer.get("drain") != "drained":
        print(f"pdserve deploy scale: the router did not drain {address} ({status}: {answer}); its own drain follows",
              file=sys.stderr)


def _remove_groups(prefix: str, exact: bool = False) -> None:
    """Remove the placement groups (of ``--tp`` workers) named ``prefix`` (``exact``) or starting with it."""
    from ray.util import get_placement_group, placement_group_table, remove_placement_group

    for entry in placement_group_table().values():
        name = entry.get("name") or ""
        if (name == prefix if exact else name.startswith(prefix)) and entry.get("state") != "REMOVED":
            remove_placement_group(get_placement_group(name))


def down(args) -> int:
    state = _load(args.name)
    ray = _connect(state)
    for name in ray.util.list_named_actors():
        ray.kill(ray.get_actor(name), no_restart=True)
    _remove_groups(state["namespace"] + "-")
    ray.shutdown()
    for pgid in state.get("local_groups") or []:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(2)
    os.remove(state_path(args.name))
    return 0
