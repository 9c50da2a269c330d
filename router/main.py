from __future__ import annotations

import logging
import os

import uvicorn

from control.auth import load_token, require_token_for
from control.listen import inherited, listen, port_of

from .app import create_app
from .config import RouterConfig

log = logging.getLogger(__name__)


def run_router(args) -> int:
    overrides = dict(host=args.host, port=args.port, prefill=args.prefill, decode=args.decode,
                     colocated=args.colocated, policy=args.policy, max_queue=args.max_queue,
                     kv_weight=getattr(args, "kv_weight", None), tokenizer=getattr(args, "tokenizer", None),
                     workers_file=getattr(args, "workers_file", None),
                     queue_timeout_s=args.queue_timeout, heartbeat_s=args.heartbeat,
                     stale_after_s=max(1.0, args.heartbeat * 2) if args.heartbeat else None,
                     dead_after_s=max(3.0, args.heartbeat * 6) if args.heartbeat else None,
                     retries=getattr(args, "retries", None), retry_wait_s=getattr(args, "retry_wait", None),
                     stall_timeout_s=getattr(args, "stall_timeout", None), rebalance=getattr(args, "rebalance", None),
                     roles=getattr(args, "roles", None), roles_profile=getattr(args, "roles_profile", None),
                     slo_ttft_ms=getattr(args, "slo_ttft_ms", None), slo_tpot_ms=getattr(args, "slo_tpot_ms", None),
                     disagg=getattr(args, "disagg", None),
                     disagg_local_tokens=getattr(args, "disagg_local_tokens", None),
                     disagg_prefill_queue=getattr(args, "disagg_prefill_queue", None),
                     disagg_prefill_wait_ms=getattr(args, "disagg_prefill_wait_ms", None),
                     warm_pairs=getattr(args, "warm_pairs", None))
    if args.config:
        cfg = RouterConfig.from_toml(args.config, **overrides)
    else:
        cfg = RouterConfig(**{k: v for k, v in overrides.items() if v not in (None, [])})
    token = load_token(path=args.cluster_token_file)
    api_key = load_api_key(args.api_key_file)
    require_token_for(cfg.host, token, "router")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("router binds %s: reachable beyond this machine%s", cfg.host,
                    "" if api_key else " and no API key is set (--api-key-file or PDSERVE_API_KEY)")
    fd = getattr(args, "listen_fd", None)
    sock = inherited(fd) if fd is not None else listen(cfg.host, cfg.port, "--port")
    if fd is None and not cfg.port:
        print(f"pdserve router: listening on http://{cfg.host}:{port_of(sock)}", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, token, api_key), log_level="warning",
                                           timeout_graceful_shutdown=30))
    server.run(sockets=[sock])
    return 0


def load_api_key(path: str | None) -> str | None:
    if path:
        with open(path) as f:
            return f.read().strip() or None
    return os.environ.get("PDSERVE_API_KEY") or None
