"""The router's options that ``pdserve router`` and ``pdserve up`` share: where prompts are prefilled
(``--disagg``), roles at runtime (``--roles``, ``--roles-profile``), rebalancing and the stall watchdog's help."""
from __future__ import annotations

import argparse

REBALANCE_HELP = ("move decoding requests off a decode worker short of KV blocks or over its TPOT SLO onto one with "
                  "room, while they stream (router.rebalance)")
ROLES_HELP = ("fixed (default) or auto: mixed workers (--mixed) settle to prefill or decode and then change roles as "
              "prompts or decoding stay pressed, or toward the split --roles-profile's model serves best "
              "(router.role_control)")
STALL_HELP = ("seconds a request may go without a word from its worker (no token, no progress) before it fails "
              "with an error saying where it stood, and runs again elsewhere if nothing reached its client; 0: never")


def add_roles_plan(p, ttft_default) -> None:
    p.add_argument("--roles-profile", default=None, help="--roles auto: an engine profile (pdserve bench engine "
                   "--profile) on which the planner's model picks, from the last 20 s of traffic, the split of the "
                   "mixed workers that keeps most requests within --slo-ttft-ms and --slo-tpot-ms (router.role_plan)")
    p.add_argument("--slo-ttft-ms", type=float, default=ttft_default, help="--roles-profile: the TTFT SLO (default "
                   "2000)")
    if ttft_default is None:  # the router's own (pdserve up's --slo-tpot-ms also caps its workers' steps)
        p.add_argument("--slo-tpot-ms", type=float, default=None, help="--roles-profile: the TPOT SLO")


def add_disagg(p: argparse.ArgumentParser, default):
    p.add_argument("--disagg", choices=["always", "never", "auto"], default=default,
                   help="where prompts are prefilled: always on prefill workers (default), never (on the decode "
                        "worker), auto (per request, from the uncached prompt length and the queues)")
    p.add_argument("--disagg-local-tokens", type=int, default=None if default is None else 512,
                   help="auto: uncached prompts of at most this many tokens are prefilled on the decode worker")
    p.add_argument("--disagg-prefill-queue", type=int, default=None,
                   help="auto: prompts in flight on every prefill worker that make them busy, until the workers "
                        "report prompt step times (default 4)")
    p.add_argument("--disagg-prefill-wait-ms", type=float, default=None,
                   help="auto: every prefill worker is busy when a prompt sent there would wait this long behind "
                        "the uncached prompt tokens in flight, at the worker's measured time a token (default 500; "
                        "0: count prompts only)")
    p.add_argument("--warm-pairs", choices=["auto", "always", "never"], default=None,
                   help="a short request through each prefill -> decode pair before /health says ready (auto: pairs "
                        "over the nccl transport, whose first transfer forms an NCCL communicator)")
