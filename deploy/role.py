"""``pdserve role --url URL --worker ADDRESS --role prefill|decode|mixed [--force]``: the router's ``/admin/role``
from the command line (a mixed worker's role at runtime: ``router.roles``)."""
from __future__ import annotations

import json
import os
import sys

from .drain import _call

ROLES = ("prefill", "decode", "mixed")


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--worker", required=True, help="the worker's address as /health lists it (tcp://HOST:PORT)")
    p.add_argument("--role", required=True, choices=ROLES, help="the groups whose picks the worker is in")
    p.add_argument("--force", action="store_true", help="leave a group even as its last worker")
    p.add_argument("--api-key-file", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")


def run(args) -> int:
    key = open(args.api_key_file).read().strip() if args.api_key_file else os.environ.get("PDSERVE_API_KEY")
    body = {"worker": args.worker, "role": args.role, "force": args.force}
    try:
        status, answer = _call(f"{args.url.rstrip('/')}/admin/role", key, body)
    except OSError as e:
        print(f"pdserve role: the router at {args.url} does not answer: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"pdserve role: {status}: {(answer.get('error') or {}).get('message', answer)}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0
