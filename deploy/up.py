"""``pdserve up``: router and workers as child processes on this machine.

``up`` binds the router's port and every worker's control port itself and
hands each child its listening socket (``--listen-fd``, ``--control-fd``;
``control.listen``): no port is named for a child to bind later, so nothing
else on the machine can take it first, and a worker restarts on the port it
had. A decode worker binds its KV port itself and reports it in its pongs.
The router is pointed at the workers, and ``up`` returns
to the caller's terminal only when the cluster stops: on Ctrl-C/SIGTERM, or
when the router dies. A worker that dies is restarted on its ports
(``deploy.supervise``) while the router serves with the others; only the
two-rank mlx transport, whose world one rank cannot re-form, stops the
cluster when a worker dies. The children share
a cluster token (a fresh one unless PDSERVE_CLUSTER_TOKEN[_FILE] is set),
passed in their environment, never on a command line."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from control.lifetime import parent_env
from control.listen import listen, port_of, reserve
from deploy.progress import bar
from deploy.rolling import restart_all
from deploy.supervise import Child, Supervisor


HELD: list = []  # the sockets ``plan`` bound for the children: open while ``up`` runs


def engine_args(args) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--transport", args.transport,
           "--engine", getattr(args, "engine", "torch")]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    out += ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
            "--decode-graphs", args.decode_graphs, "--tp", str(getattr(args, "tp", 1)),
            "--pp", str(getattr(args, "pp", 1)), "--pp-transport", getattr(args, "pp_transport", "tcp"),
            "--load-format", getattr(args, "load_format", "auto"),
            "--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto")]
    if getattr(args, "quantization", None):
        out += ["--quantization", args.quantization]
    if getattr(args, "pp_layers", None):
        out += ["--pp-layers", args.pp_layers]
    if args.max_batched_tokens:
        out += ["--max-batched-tokens", str(args.max_batched_tokens)]
    for flag in ("step_prefill_tokens", "slo_tpot_ms"):
        if getattr(args, flag, None) is not None:
            out += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if getattr(args, "kv_host_bytes", 0):
        out += ["--kv-host-bytes", str(args.kv_host_bytes)]
    if getattr(args, "kv_pool", None):
        out += ["--kv-pool", args.kv_pool, "--kv-pool-bytes", str(args.kv_pool_bytes)]
    if getattr(args, "kv_disk", None):
        out += ["--kv-disk", args.kv_disk, "--kv-disk-bytes", str(args.kv_disk_bytes)]
    if args.ray_address:
        out += ["--ray-address", args.ray_address]
    if not getattr(args, "prefix_caching", True):
        out += ["--no-prefix-caching"]
    if not getattr(args, "overlap", True):
        out += ["--no-overlap"]
    if not getattr(args, "warmup", True):
        out += ["--no-warmup"]
    if args.transport == "mlx":
        out += ["--mlx-backend", args.mlx_backend]
    for key, value in args.kv_option:
        out += ["--kv-option", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return out


def role_engine(args, role: str) -> list[str]:
    """``--prefill-engine``/``-tp``/``-device`` and the decode ones (a later flag wins over the shared one)."""
    out = []
    for flag in ("engine", "tp", "pp", "pp_layers", "device", "kv_cache_dtype"):
        value = getattr(args, f"{role}_{flag}", None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def last_int(cmd: list[str], flag: str) -> int:
    """The value of the last ``flag`` on a command line (a role's own flag comes after the shared one)."""
    return int(cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1])


def ranked(args) -> bool:
    """Whether the workers form a fixed world of ranks (the mlx transport), which a restart cannot rejoin."""
    return args.transport == "mlx" and not args.colocated


def rank_args(args, host: str, held: list) -> list[list[str]] | None:
    """Per-rank arguments of a fixed two-rank world (the mlx transport): rank 0 is the prefill worker, rank 1 decode.
    A hostfile made here names ports that ``held`` keeps reserved (``control.listen.reserve``: MLX's ring binds them
    with SO_REUSEPORT); it is removed when ``up`` exits."""
    if not ranked(args):
        return None
    if args.prefill != 1 or args.decode != 1:
        raise RuntimeError(f"the {args.transport} transport pairs exactly one prefill with one decode worker "
                           "(--prefill 1 --decode 1)")
    hostfile = args.mlx_hostfile
    if not hostfile:
        fd, hostfile = tempfile.mkstemp(prefix="pdserve-mlx-", suffix=".json")
        ranks = [reserve(host) for _ in range(2)]
        held.extend(ranks)
        with os.fdopen(fd, "w") as f:
            json.dump([[f"{host}:{port_of(sock)}"] for sock in ranks], f)
        atexit.register(_remove, hostfile)
    return [["--mlx-hostfile", hostfile, "--mlx-rank", str(rank)] for rank in (0, 1)]


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def plan(args, router=None, held: list | None = None) -> list[list[str]]:
    """The command lines of every child: workers first, the router last (``cmd[5]`` names the role). Each worker's
    control socket is bound here and kept in ``held`` (the caller keeps them open while the cluster runs: a restarted
    worker gets the same one); ``router``: the router's listening socket (None: the router binds ``--port``)."""
    held = HELD if held is None else held
    base = [sys.executable, "-m", "pdserve", "--log-level", os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")]
    host, eng = args.host, engine_args(args)
    cmds, roles = [], {"prefill": [], "decode": [], "colocated": []}
    budget = ["--kv-budget", str(args.kv_budget)] if args.kv_budget else []
    per_rank = rank_args(args, host, held) or [[]] * (args.prefill + args.decode)

    def control(role: str) -> list[str]:
        """``--control-fd`` of a socket bound now (its port named too, for ``ps``), listed for the router as a worker
        of ``role``."""
        sock = listen(host)
        held.append(sock)
        roles[role].append(f"tcp://{host}:{port_of(sock)}")
        return ["--host", host, "--port", str(port_of(sock)), "--control-fd", str(sock.fileno())]

    if args.colocated:
        for _ in range(max(1, args.decode)):
            cmds.append(base + ["decode", "--colocated"] + control("colocated") + eng + budget
                        + role_engine(args, "decode"))
    else:
        for i in range(args.prefill):
            stream = [] if getattr(args, "kv_stream", True) else ["--no-kv-stream"]
            cmds.append(base + ["prefill"] + control("prefill") + eng + per_rank[i] + stream
                        + role_engine(args, "prefill"))
        for i in range(args.decode):
            cmds.append(base + ["decode"] + control("decode") + eng + per_rank[args.prefill + i] + budget
                        + role_engine(args, "decode"))
        for _ in range(getattr(args, "mixed", 0)):
            cmds.append(base + ["decode", "--role", "mixed"] + control("decode") + eng + budget
                        + role_engine(args, "decode"))
            roles["prefill"].append(roles["decode"][-1])
    gpus = getattr(args, "gpus", 0)
    if not gpus and args.transport == "nccl" and not args.colocated and args.device in ("auto", "cuda"):
        gpus = 2  # the nccl transport moves KV between GPUs: prefill on cuda:0, decode on cuda:1 (1P1D)
    if gpus:  # each worker on the next of its TP ranks' GPUs (mod gpus); a later --device wins over the shared one
        placed, cursor = [], 0
        for cmd in cmds:
            if getattr(args, f"{cmd[5]}_device", None):
                placed.append(cmd)
                continue
            tp = last_int(cmd, "--tp") * last_int(cmd, "--pp")  # the GPUs the worker's ranks or stages take
            first = cursor % gpus if cursor % gpus + tp <= gpus else 0
            placed.append(cmd + ["--device", f"cuda:{first}"])
            cursor = first + tp
        cmds = placed
    listening = ["--listen-fd", str(router.fileno())] if router is not None else ["--port", str(args.port)]
    router = base + ["router", "--host", host, *listening, "--policy", args.policy,
                     "--max-queue", str(args.max_queue), "--kv-weight", str(getattr(args, "kv_weight", 0.5)),
                     "--retries", str(getattr(args, "retries", 2)),
                     "--retry-wait", str(getattr(args, "retry_wait", 3.0)),
                     "--stall-timeout", str(getattr(args, "stall_timeout", 30.0)), "--disagg", getattr(args, "disagg", "always"),
                     "--disagg-local-tokens", str(getattr(args, "disagg_local_tokens", 512))]
    if getattr(args, "disagg_prefill_queue", None):
        router += ["--disagg-prefill-queue", str(args.disagg_prefill_queue)]
    if getattr(args, "disagg_prefill_wait_ms", None) is not None:
        router += ["--disagg-prefill-wait-ms", str(args.disagg_prefill_wait_ms)]
    if getattr(args, "warm_pairs", None):
        router += ["--warm-pairs", args.warm_pairs]
    if getattr(args, "rebalance", False):
        router += ["--rebalance"]
    if getattr(args, "roles", "fixed") == "auto":
        router += ["--roles", "auto"]
    if getattr(args, "roles_profile", None):
        router += ["--roles-profile", os.path.abspath(args.roles_profile), "--slo-ttft-ms", str(args.slo_ttft_ms),
                   "--slo-tpot-ms", str(args.slo_tpot_ms)]
    for role, addrs in roles.items():
        for a in addrs:
            router += [f"--{role}", a]
    return cmds + [router]


def wait_ready(url: str, procs, timeout: float) -> dict:
    """The router's /health once every worker it knows is healthy (a worker still loading its model would leave
    the first requests, and a benchmark's first rate, to part of the cluster), with a bar of the healthy workers on
    stderr. A child that exits before the router first said ready is a failed start; one that exits after it
    (``ready_since``: clients polling /health may be using the cluster) is left to the supervisor, which restarts
    it."""
    end, waiting = time.monotonic() + timeout, "the router"
    with bar(desc="starting", unit="worker") as progress:
        while time.monotonic() < end:
            dead = [p for p in procs if p.poll() is not None]
            health = _health(url)
            if health is not None:
                _show(progress, health)
            if health is not None and health.get("status") == "ok" and not unhealthy_workers(health):
                return health
            if dead:
                if (health or {}).get("ready_since"):
                    return health  # clients were told ready: the supervisor restarts the child
                raise RuntimeError(f"a child exited early: {' '.join(dead[0].args[3:6])} (code {dead[0].returncode})")
            if health is not None:
                waiting = ", ".join(unhealthy_workers(health)) or health.get("status", "the router")
            time.sleep(0.3)
    raise TimeoutError(f"cluster not healthy after {timeout:.0f}s (waiting for {waiting})")


def _show(progress, health: dict) -> None:
    """The bar at the healthy workers of /health's list (the router warming up counts as one step more)."""
    listed = [w for group in (health.get("workers") or {}).values() for w in group]
    healthy = sum(bool(w.get("healthy")) for w in listed) + (health.get("status") == "ok")
    if progress.total != len(listed) + 1 or progress.n != healthy:
        progress.total, progress.n = len(listed) + 1, healthy
        progress.set_postfix_str(", ".join(unhealthy_workers(health)) or health.get("status", ""), refresh=False)
        progress.refresh()


def _health(url: str) -> dict | None:
    """The router's /health body, 503s included; None while it does not answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def unhealthy_workers(health: dict) -> list[str]:
    """``role address`` of each worker the router's /health lists as not healthy (none listed: the router's)."""
    workers = health.get("workers") or {}
    if not any(workers.values()):
        return ["workers to register"]
    return [f"{role} {w.get('address')}" for role, group in workers.items() for w in group if not w.get("healthy")]


def stop(procs, grace: float = 30.0) -> None:
    """SIGTERM every child, router first; each finishes its in-flight work (bounded) and exits."""
    for p in sorted(procs, key=lambda p: p.args[5] != "router"):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def place_stages(args) -> None:
    """``--pp-nodes``: ``--pp`` and ``--pp-layers`` from ``pdserve plan placement`` (``planner.placement``)."""
    from planner.placement import Node, Shape, bytes_per_weight, model_config, place_stage_zero, table

    if not args.max_model_len:
        raise SystemExit("--pp-nodes needs --max-model-len (the context each node keeps room for)")
    dtype = args.dtype if args.dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    shape = Shape.of(model_config(args.model), bytes_per_weight(dtype, None), 1.0 if args.kv_cache_dtype == "fp8"
                     else bytes_per_weight(dtype, None))
    try:
        stages = place_stage_zero([Node.parse(n) for n in args.pp_nodes.split(",") if n], shape,
                                  args.max_model_len * args.max_num_seqs, usable=0.9)
    except ValueError as e:
        raise SystemExit(f"--pp-nodes: {e}") from None
    args.pp, args.pp_layers = len(stages), ",".join(str(s.layers) for s in stages)
    print(table(stages), f"\n--pp {args.pp} --pp-layers {args.pp_layers}", flush=True)


def up(args) -> int:
    if getattr(args, "roles_profile", None) and (args.roles != "auto" or not args.slo_tpot_ms):
        print("pdserve up: --roles-profile needs --roles auto and --slo-tpot-ms", file=sys.stderr)
        return 2
    router_socket = listen(args.host, args.port, "--port")  # taken: PortInUse, one line and exit 2 (pdserve.cli)
    args.port = port_of(router_socket)
    if getattr(args, "pp_nodes", None):
        place_stages(args)
    procs, supervisor = [], None
    stopping = rolling = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    def on_hangup(*_):
        nonlocal rolling
        rolling = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)  # a rolling restart (deploy.rolling)
    url = f"http://{args.host}:{args.port}"
    ray_cluster, pool_servers, env = None, None, dict(os.environ)
    from control.auth import TOKEN_ENV, TOKEN_FILE_ENV, new_token

    if not (env.get(TOKEN_ENV) or env.get(TOKEN_FILE_ENV)):
        env[TOKEN_ENV] = new_token()
    env.update(parent_env())  # the children stop when up dies, even by SIGKILL (control.lifetime)
    try:
        if getattr(args, "kv_pool", None) == "mooncake":
            from deploy.kv_pool_servers import KVPoolServers

            pool_servers = KVPoolServers(args.kv_pool_bytes).start()
            args.kv_pool = f"mooncake://{pool_servers.address}"
        if args.transport == "ray" and not args.colocated and not args.ray_address:
            from deploy.raycluster import RayCluster

            ray_cluster = RayCluster(token=os.environ.get("RAY_AUTH_TOKEN")).start()
            env.update(ray_cluster.env)
        cmds = plan(args, router=router_socket)
        supervisor = Supervisor(max_restarts=args.max_restarts)
        counts: dict = {}
        for cmd in sorted(cmds, key=lambda c: c[5] != "router"):  # the router starts while up imports the workers'
            role = "colocated" if "--colocated" in cmd else "mixed" if "mixed" in cmd else cmd[5]
            counts[role] = counts.get(role, 0) + 1
            supervisor.add(Child(f"{role} worker {counts[role] - 1}" if role != "router" else "router", cmd, env,
                                 restartable=role != "router" and not ranked(args)))
        procs = supervisor.procs
        health = wait_ready(url, procs, args.ready_timeout)
        mode = health.get("mode")
        print(f"pdserve is up ({mode}, transport={args.transport if mode != 'colocated' else 'none'}): {url}", flush=True)
        print(f"  try: curl -N {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\":\"{args.model if args.model == 'tiny-llama' else '<model>'}\",\"prompt\":\"Hello\",\"max_tokens\":32,\"stream\":true}}'",
              flush=True)
        while not stopping:
            if rolling:
                rolling = False
                restart_all(supervisor.children, url, args.ready_timeout)
            fatal = supervisor.check()
            if fatal is not None:
                print(f"pdserve: the {fatal.name} exited (code {fatal.proc.returncode}); stopping the cluster",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as e:
        if not stopping:
            print(f"pdserve up failed: {e}", file=sys.stderr)
            return 1
        return 0
    finally:
        stop(supervisor.procs if supervisor else procs)
        if ray_cluster:
            ray_cluster.stop()
        if pool_servers:
            pool_servers.stop()
