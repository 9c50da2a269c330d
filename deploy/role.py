"""``pdserve role --url URL --worker ADDRESS --role prefill|decode|mixed [--force]``: the router's ``/admin/role``
from the command line (a mixed worker's role at runtime: ``router.roles``)."""
from __future__ import annotations

from .drain import answered, api_key, router_call

ROLES = ("prefill", "decode", "mixed")


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--worker", required=True, help="the worker's address as /health lists it (tcp://HOST:PORT)")
    p.add_argument("--role", required=True, choices=ROLES, help="the groups whose picks the worker is in")
    p.add_argument("--force", action="store_true", help="leave a group even as its last worker")
    p.add_argument("--api-key-file", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")


def run(args) -> int:
    body = {"worker": args.worker, "role": args.role, "force": args.force}
    call = lambda: router_call(f"{args.url.rstrip('/')}/admin/role", api_key(args), body)  # noqa: E731
    return 0 if answered("role", args.url, call) is not None else 1
