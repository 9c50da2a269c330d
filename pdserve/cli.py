"""The ``pdserve`` command: router | prefill | decode | up | deploy | plan | bench (``python -m pdserve``).

The top of the import graph: it imports every package and none imports it."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from control.listen import PortInUse, handed_over
from deploy.units import byte_size

from .router_options import REBALANCE_HELP, ROLES_HELP, STALL_HELP, add_disagg, add_roles_plan

def kv_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE``; the value becomes a bool, an int (sizes like 2G too) or stays a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, byte_size(value)
    except (argparse.ArgumentTypeError, ValueError):
        return key, value


def _add_engine(p: argparse.ArgumentParser):
    p.add_argument("--model", default="tiny-llama", help="'tiny-llama' (built in) or a local Hugging Face checkpoint dir")
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "mlx"],
                   help="model runner: torch, or mlx (mlx-lm's models; auto: mlx on macOS when mlx-lm is installed)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block of the paged pool")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences one engine step may batch")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt (default: reuse the KV blocks of prompt prefixes seen before)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read each decode step's tokens before the next is launched (default: one step ahead)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="serve at once (default: a short warm-up workload first, so the first requests pay no "
                        "compiles or allocator growth)")
    p.add_argument("--decode-graphs", choices=["auto", "off", "cuda", "eager"], default="auto",
                   help="decode steps as CUDA graphs over Triton kernels (auto: on CUDA when triton imports); eager: "
                        "the same fixed-shape step run without graphs (any device; the step ahead works with it)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="tokens one engine step may compute; longer prompts are prefilled in chunks (default: 8192 "
                        "on a GPU, 2048 on the CPU)")
    p.add_argument("--step-prefill-tokens", type=int, default=None,
                   help="prompt tokens a step that also decodes may take (default: --max-batched-tokens)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="learn that cap from measured steps: a step that decodes takes the prompt tokens that keep "
                   "every decoding stream's mean time per token within this many ms")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: processes with one device each "
                   "(cuda:K..K+N-1 from --device cuda:K; gloo ranks on the CPU)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: processes each holding a contiguous range of "
                   "layers and their KV (cuda:K..K+N-1 from --device cuda:K; one CPU process each)")
    p.add_argument("--pp-layers", default=None, help="layers per stage, e.g. 10,22 (default: as even as can be; "
                   "`pdserve plan placement` prints one that fits each node)")
    p.add_argument("--pp-transport", default="tcp", help="the kvtransfer transport carrying hidden states between "
                   "stages: tcp | shm | nccl | nixl | ...")
    p.add_argument("--pp-placement-group", default=None, help=argparse.SUPPRESS)  # set by `deploy ray --pp-spread`
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights made on each rank's device at load; --model is then a shape name "
                        "(llama-3-70b, mistral-7b, ...) or a directory with a config.json")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="what the KV pool stores: auto (the model's dtype) or fp8 (e4m3, a scale per layer for K and "
                        "V: half the bytes per token in the pool and on every transport)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: FP8 weights with per-output-channel scales, activations quantized per token (CUDA, "
                        "compute capability 8.9+); an FP8 checkpoint loads as it is, a bf16 one is quantized at load")
    p.add_argument("--kv-host-bytes", type=byte_size, default=0, help="each worker's host-memory KV tier, e.g. 80G: "
                   "blocks its GPU pool evicts stay there and come back on a prefix hit (docs/kv-tiers.md)")
    p.add_argument("--kv-disk", default=None, help="a directory for a disk KV tier under the host tier")
    p.add_argument("--kv-disk-bytes", type=byte_size, default=0, help="the disk tier's size, e.g. 2T")
    p.add_argument("--kv-pool", default=None, metavar="mooncake|mooncake://HOST:PORT", help="a cluster-wide KV "
                   "pool on Mooncake Store: prefixes any worker computed, fetched from the store (up: mooncake starts "
                   "its master and this host's daemon; a worker: the daemon's address)")
    p.add_argument("--kv-pool-bytes", type=byte_size, default=4 << 30, help="up --kv-pool mooncake: the pool's "
                   "memory on this host (the daemon's segment; default 4G)")
    p.add_argument("--transport", default="tcp", help="tcp | shm | pickle | ray | ...")
    p.add_argument("--ray-address", default=None, help="ray transport: cluster to join (default: RAY_ADDRESS, or "
                   "`up` starts one)")
    p.add_argument("--mlx-backend", default="ring", help="mlx transport: ring (TCP) | jaccl (Thunderbolt RDMA) | any")
    p.add_argument("--mlx-hostfile", default=None, help="mlx transport: MLX hostfile (JSON)")
    p.add_argument("--kv-option", action="append", default=[], type=kv_option, metavar="KEY=VALUE",
                   help="a transport option, repeatable: device=cuda:1, nccl_backend=gloo, "
                        "nixl_pool_bytes=2G, nixl_progress_thread=true, mlx_pool_bytes=1G, ...")


def _add_worker(p: argparse.ArgumentParser):
    p.add_argument("--host", default="127.0.0.1", help="address to bind (control and KV ports)")
    p.add_argument("--port", type=int, default=0, help="control port (0 = pick a free one)")
    p.add_argument("--control-fd", type=int, default=None, help="a listening socket inherited as this descriptor, "
                   "bound by whoever started the worker (pdserve up does); --port, if given, names its port")
    p.add_argument("--kv-timeout", type=float, default=30.0, help="seconds a KV transfer may take")
    p.add_argument("--max-transfer-bytes", type=byte_size, default=8 << 30, help="the largest KV transfer a decode "
                   "worker takes (never below one sequence's KV at the model's whole context)")
    p.add_argument("--cluster-token-file", default=None, help="file with the cluster token (or PDSERVE_CLUSTER_TOKEN); "
                   "required when binding beyond loopback")
    p.add_argument("--drain-timeout", type=float, default=20.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--mlx-rank", type=int, default=None, help="mlx transport: this worker's rank in the hostfile")
    _add_engine(p)


def _parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """``with_bench=False``: the benchmarks' own options left out (their modules import torch, which the router and
    ``up`` never need)."""
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("router", help="HTTP front end (OpenAI API)")
    r.add_argument("--host", default=None)
    r.add_argument("--port", type=int, default=None, help="port to listen on (default 8000; 0 = pick a free one, "
                   "printed at start)")
    r.add_argument("--listen-fd", type=int, default=None, help="a listening socket inherited as this descriptor, "
                   "bound by whoever started the router (pdserve up does), instead of --host/--port")
    r.add_argument("--prefill", action="append", default=[], help="prefill worker tcp://host:port (repeatable)")
    r.add_argument("--decode", action="append", default=[], help="decode worker tcp://host:port (repeatable)")
    r.add_argument("--colocated", action="append", default=[], help="colocated worker tcp://host:port (repeatable)")
    r.add_argument("--policy", default=None, help="least_outstanding | round_robin | kv_aware")
    r.add_argument("--kv-weight", type=float, default=None, help="kv_aware: weight of load against cached prefix "
                   "(0: prefix only)")
    r.add_argument("--tokenizer", default=None, help="kv_aware: 'builtin' or a checkpoint dir (default: the one "
                   "the workers report, when it exists here)")
    r.add_argument("--config", default=None, help="TOML file with a [router] table")
    r.add_argument("--cluster-token-file", default=None, help="file with the cluster token (or PDSERVE_CLUSTER_TOKEN)")
    r.add_argument("--api-key-file", default=None, help="file with the API key clients must send (or PDSERVE_API_KEY)")
    r.add_argument("--heartbeat", type=float, default=None, help="seconds between worker pings (default 0.25; out "
                   "of the picks after max(1s, 2 intervals) without a pong, its requests failed after max(3s, 6))")
    r.add_argument("--retries", type=int, default=None, help="times a request that failed before decode streamed a "
                   "token runs again on other workers (default 2)")
    r.add_argument("--retry-wait", type=float, default=None, help="seconds a retry waits for a worker of each role it "
                   "needs to be in the picks, e.g. a restarting one (default 3); a new request waits as long, 5 s at least")
    r.add_argument("--stall-timeout", type=float, default=None, help=STALL_HELP + " (default 30)")
    r.add_argument("--rebalance", action="store_true", default=None, help=REBALANCE_HELP)
    r.add_argument("--roles", choices=("fixed", "auto"), default=None, help=ROLES_HELP)
    add_roles_plan(r, None)
    add_disagg(r, None)
    r.add_argument("--max-queue", type=int, default=None, help="requests that may wait for KV memory (then 429)")
    r.add_argument("--queue-timeout", type=float, default=None, help="seconds a request may wait (then 503)")
    r.add_argument("--workers-file", default=None, help="JSON {prefill: [...], decode: [...]} of worker addresses, "
                   "re-read every second (what `pdserve deploy ray` keeps current)")

    p = sub.add_parser("prefill", help="prefill worker")
    _add_worker(p)
    p.add_argument("--kv-budget", type=byte_size, default=0, help="KV pool size, e.g. 4G (default: room for "
                   "--max-num-seqs full-context sequences, at most half the free memory, 2G on the CPU)")
    p.add_argument("--max-queue", type=int, default=64, help="prompts that may wait (then 503)")
    p.add_argument("--no-kv-stream", dest="kv_stream", action="store_false",
                   help="send the KV after the prefill forward ends (default: layer by layer while it runs)")

    d = sub.add_parser("decode", help="decode worker")
    _add_worker(d)
    d.add_argument("--kv-port", type=int, default=0, help="KV transport port (0 = pick a free one)")
    d.add_argument("--colocated", action="store_true", help="also run prefill here; no KV transfer (baseline)")
    d.add_argument("--role", choices=["decode", "mixed"], default="decode", help="mixed: also prefill prompts for "
                   "other decode workers (list it as both --prefill and --decode of the router)")
    d.add_argument("--kv-budget", type=byte_size, default=0, help="KV pool size, e.g. 4G (default: room for "
                   "--max-num-seqs full-context sequences, at most half the free memory, 2G on the CPU)")

    u = sub.add_parser("up", help="router + workers as local processes")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    u.add_argument("--decode", type=int, default=1, help="number of decode workers")
    u.add_argument("--colocated", action="store_true", help="single-machine baseline: workers do prefill+decode")
    u.add_argument("--mixed", type=int, default=0, help="mixed workers: decode, and prefill for the others (each "
                   "listed as a prefill and a decode worker)")
    u.add_argument("--policy", default="least_outstanding", help="least_outstanding | round_robin | kv_aware")
    u.add_argument("--kv-weight", type=float, default=0.5, help="kv_aware: weight of load against cached prefix")
    u.add_argument("--ready-timeout", type=float, default=180.0)
    u.add_argument("--kv-budget", type=byte_size, default=0, help="per decode worker KV memory budget, e.g. 4G")
    add_disagg(u, "always")
    u.add_argument("--max-queue", type=int, default=256, help="router: requests that may wait for KV memory")
    u.add_argument("--max-restarts", type=int, default=10, help="restarts of a dead worker before it is left down")
    u.add_argument("--retries", type=int, default=2, help="router: times a request that failed before decode "
                   "streamed a token runs again on other workers")
    u.add_argument("--retry-wait", type=float, default=3.0, help="router: seconds a retry waits for a worker to be in "
                   "the picks (with one worker of a role: longer than it takes to restart); a new request waits as long, 5 s "
                   "at least")
    u.add_argument("--stall-timeout", type=float, default=30.0, help="router: " + STALL_HELP)
    u.add_argument("--rebalance", action="store_true", help="router: " + REBALANCE_HELP)
    u.add_argument("--roles", choices=("fixed", "auto"), default="fixed", help="router: " + ROLES_HELP)
    add_roles_plan(u, 2000.0)
    u.add_argument("--pp-nodes", default=None, help="name:memGB[:speed],...: the nodes a pipeline's stages stand "
                   "for; `pdserve plan placement` picks --pp and --pp-layers so that each holds its weights and the KV "
                   "of --max-model-len x --max-num-seqs tokens (the stages run on this machine)")
    u.add_argument("--gpus", type=int, default=0, help="spread the workers over this many GPUs (worker i on "
                   "cuda:i mod N), e.g. --colocated --decode 2 --gpus 2: one replica per GPU")
    u.add_argument("--prefill-engine", default=None, choices=["auto", "torch", "mlx"],
                   help="engine of the prefill workers (default: --engine), e.g. a heterogeneous pair")
    u.add_argument("--decode-engine", default=None, choices=["auto", "torch", "mlx"],
                   help="engine of the decode (or colocated) workers (default: --engine)")
    u.add_argument("--no-kv-stream", dest="kv_stream", action="store_false",
                   help="prefill sends the KV after its forward ends (default: layer by layer while it runs)")
    for role in ("prefill", "decode"):
        u.add_argument(f"--{role}-tp", type=int, default=None, help=f"tensor-parallel ranks of each {role} "
                       f"worker (default: --tp){' (colocated workers too)' if role == 'decode' else ''}")
        u.add_argument(f"--{role}-pp", type=int, default=None, help=f"pipeline stages of each {role} worker "
                       f"(default: --pp){' (colocated workers too)' if role == 'decode' else ''}")
        u.add_argument(f"--{role}-pp-layers", default=None, help=f"layers per stage of the {role} workers "
                       "(default: --pp-layers)")
        u.add_argument(f"--{role}-device", default=None, help=f"device of the {role} workers (default: --device), "
                       "e.g. --prefill-tp 2 --decode-device cuda:1")
        u.add_argument(f"--{role}-kv-cache-dtype", default=None, choices=["auto", "fp8"],
                       help=f"KV dtype of the {role} workers (default: --kv-cache-dtype); the decode side converts "
                            "KV that arrives in another")
    _add_engine(u)

    from planner import cli as plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help="the best configuration of these GPUs for a workload and "
                                          "SLOs, simulated from measured engine profiles"))

    from deploy import drain, role

    drain.add_arguments(sub.add_parser("drain", help="take a worker out of the picks, its decoding requests moved "
                                       "to the others (the router's /admin/drain)"))
    role.add_arguments(sub.add_parser("role", help="a mixed worker's role at runtime: prefill, decode or mixed "
                                      "(the router's /admin/role)"))
    dp = sub.add_parser("deploy", help="a cluster on Ray: roles as actors, placed, restarted and scaled by Ray")
    dsub = dp.add_subparsers(dest="deploy", required=True)
    dr = dsub.add_parser("ray", help="start a deployment")
    dr.add_argument("--address", default=None, help="Ray cluster to use (default: start a local one)")
    dr.add_argument("--name", default="default")
    dr.add_argument("--prefill", type=int, default=1)
    dr.add_argument("--decode", type=int, default=1)
    dr.add_argument("--gpus-per-worker", type=float, default=0)
    dr.add_argument("--prefill-resources", default=None, help='JSON, e.g. \'{"pdserve-prefill": 0.01}\'')
    dr.add_argument("--decode-resources", default=None, help='JSON, e.g. \'{"pdserve-decode": 0.01}\'')
    dr.add_argument("--host", default=None, help="router bind address (default: its node's address)")
    dr.add_argument("--port", type=int, default=8000)
    dr.add_argument("--policy", default="least_outstanding")
    add_disagg(dr, "always")
    dr.add_argument("--pp-spread", action="store_true", help="each pipeline stage (--pp) on a node of its own (with "
                    "--gpus-per-worker GPUs), placed by Ray; default: a worker's stages on one node")
    dr.add_argument("--max-restarts", type=int, default=10)
    dr.add_argument("--kv-budget", type=byte_size, default=0)
    dr.add_argument("--cluster-token-file", default=None)
    dr.add_argument("--api-key-file", default=None)
    _add_engine(dr)
    for verb, text in (("status", "roles, nodes, health, restarts"), ("scale", "add or drain workers"),
                       ("down", "remove every actor and process of a deployment")):
        d = dsub.add_parser(verb, help=text)
        d.add_argument("--name", default="default")
        if verb == "status":
            d.add_argument("--json", action="store_true")
        if verb == "scale":
            d.add_argument("--prefill", type=int, default=None)
            d.add_argument("--decode", type=int, default=None)

    b = sub.add_parser("bench", help="benchmarks")
    if with_bench:
        _bench_parsers(b.add_subparsers(dest="bench", required=True))
    return ap


def _bench_parsers(bsub) -> None:
    from bench import (chaos, compare, engine, fp8, goodput, guided, idle, kernels, migrate, pipeline, replay, router,
                       serve, soak, stream, transfer)

    migrate.add_arguments(bsub.add_parser("migrate", help="streams undisturbed and then drained off a decode worker: "
                                          "errors, equal texts, gaps between tokens, each move's stall"))

    guided.add_arguments(bsub.add_parser("guided", help="xgrammar vs llguidance: compile and mask time per token"))
    pipeline.add_arguments(bsub.add_parser("pipeline", help="one device vs --pp 2 vs --tp 2 over a shaped link: "
                                           "prefill, decode, each hop's phases"))
    transfer.add_arguments(bsub.add_parser("transfer", help="KV transfer A/B between two processes"))
    serve.add_arguments(bsub.add_parser("serve", help="load generator against an OpenAI-compatible endpoint"))
    compare.add_arguments(bsub.add_parser("compare", help="colocated baseline vs disaggregated, per transport"))
    soak.add_arguments(bsub.add_parser("soak", help="many streams for a long time: errors and memory growth"))
    chaos.add_arguments(bsub.add_parser("chaos", help="streams while random workers are SIGKILLed: requests ok, "
                                        "failed before the first byte or mid-stream, leaked KV blocks, RSS growth"))
    engine.add_arguments(bsub.add_parser("engine", help="engine throughput alone: batched decode, offline requests"))
    goodput.add_arguments(bsub.add_parser("goodput", help="highest request rate within the SLO, per pdserve up "
                                          "configuration (Poisson arrivals over a sweep of rates)"))
    stream.add_arguments(bsub.add_parser("stream", help="KV transfer left after the prefill forward, layer-wise "
                                         "streaming on and off"))
    idle.add_arguments(bsub.add_parser("idle", help="prefill forward after decode, spin or sleep (the cold-worker effect)"))
    kernels.add_arguments(bsub.add_parser("kernels", help="each decode-step kernel and whole steps: time, bytes or "
                                          "FLOPs, fraction of the measured bandwidth and matmul rate"))
    fp8.add_arguments(bsub.add_parser("fp8", help="FP8 weights and FP8 KV cache against bf16 in one run: decode "
                                      "tok/s, sequences per KV budget, long-context steps, logits agreement"))
    router.add_arguments(bsub.add_parser("router", help="tokens/s one router process streams to clients (a fake "
                                         "worker feeds it as fast as asked)"))
    replay.add_arguments(bsub.add_parser("replay", help="a production trace (Mooncake JSONL, Azure CSV) replayed: "
                                         "latencies, goodput, prompt tokens reused (ideal, LRU, as the workers said)"))


def _engine_config(args):
    from engine.config import EngineConfig

    return EngineConfig.from_options(args)


def _transport_config(args, port=0):
    from kvtransfer import TransportConfig

    options = {"ray_address": args.ray_address, "mlx_backend": args.mlx_backend, "mlx_hostfile": args.mlx_hostfile,
               "mlx_rank": args.mlx_rank}
    options = {**{k: v for k, v in options.items() if v is not None}, **dict(args.kv_option)}
    from control.auth import load_token

    return TransportConfig(host=args.host, port=port, timeout_s=args.kv_timeout, max_transfer_bytes=args.max_transfer_bytes,
                           options=options, token=load_token(path=args.cluster_token_file))


def main(argv=None) -> int:
    """The command; a port the user named that is taken ends it with one line and exit code 2."""
    from control.lifetime import follow_parent

    follow_parent()
    try:
        return _main(argv)
    except PortInUse as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(with_bench="bench" in argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack on stderr
    if args.cmd == "router":
        from router.main import run_router

        return run_router(args)
    if args.cmd == "deploy":
        from deploy import ray_deploy

        if args.deploy == "ray":
            from deploy.up import engine_args

            args.worker_args = engine_args(args) + (["--kv-budget", str(args.kv_budget)] if args.kv_budget else [])
            args.router_args = ["--policy", args.policy, "--disagg", args.disagg,
                                "--disagg-local-tokens", str(args.disagg_local_tokens)]
            for flag in ("disagg_prefill_queue", "disagg_prefill_wait_ms"):
                if getattr(args, flag, None) is not None:
                    args.router_args += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        return getattr(ray_deploy, {"ray": "deploy_ray"}.get(args.deploy, args.deploy))(args)
    if args.cmd in ("prefill", "decode"):
        args.port = handed_over(args.control_fd, args.port)  # the socket inherited, or the port to bind
    if args.cmd == "prefill":
        from prefill.worker import PrefillWorker

        PrefillWorker(_engine_config(args), args.transport, args.host, args.port, _transport_config(args),
                      max_queue=args.max_queue, drain_s=args.drain_timeout, kv_stream=args.kv_stream).serve_forever()
        return 0
    if args.cmd == "decode" and args.role == "mixed":
        from decode.mixed import MixedWorker

        MixedWorker(_engine_config(args), args.transport, args.host, args.port, args.kv_port,
                    _transport_config(args, args.kv_port), kv_budget_bytes=args.kv_budget,
                    drain_s=args.drain_timeout).serve_forever()
        return 0
    if args.cmd == "decode":
        from decode.worker import DecodeWorker

        DecodeWorker(_engine_config(args), args.transport, args.host, args.port, args.kv_port, args.colocated,
                     _transport_config(args, args.kv_port), kv_budget_bytes=args.kv_budget,
                     drain_s=args.drain_timeout).serve_forever()
        return 0
    if args.cmd == "drain":
        from deploy import drain

        return drain.run(args)
    if args.cmd == "role":
        from deploy import role

        return role.run(args)
    if args.cmd == "up":
        from deploy.up import up

        return up(args)
    if args.cmd == "plan":
        from bench.plan_validate import validate
        from planner import cli as plan_cli

        return plan_cli.run(args, validate)
    if args.cmd == "bench":
        import importlib

        return importlib.import_module(f"bench.{args.bench}").run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
