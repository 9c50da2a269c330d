"""``pdserve drain --url URL --worker ADDRESS [--force] [--wait S] [--undo]``: the router's ``/admin/drain`` (or
``/admin/undrain``) from the command line; with ``--wait``, until ``/health`` shows the worker ``drained``."""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--worker", required=True, help="the worker's address as /health lists it (tcp://HOST:PORT)")
    p.add_argument("--force", action="store_true", help="drain the last worker of its role too")
    p.add_argument("--undo", action="store_true", help="undrain: back into the picks")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for it to hold nothing (0: do not wait)")
    p.add_argument("--api-key-file", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")


def router_call(url: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def worker_state(url: str, address: str, key: str | None = None) -> dict:
    """What the router's ``/health`` lists for the worker at ``address`` ({} while it does not answer or list it)."""
    try:
        health = router_call(f"{url.rstrip('/')}/health", key)[1]
    except (OSError, ValueError):
        return {}
    for group in (health.get("workers") or {}).values():
        for w in group:
            if w.get("address") == address:
                return w
    return {}


def drain(url: str, address: str, key: str | None, force: bool = False, wait_s: float = 0.0,
          undo: bool = False) -> tuple[int, dict]:
    """The router's answer (status, body); with ``wait_s``, its ``drain`` state once drained or the time is up."""
    url = url.rstrip("/")
    body = {"worker": address} if undo else {"worker": address, "force": force}
    status, answer = router_call(f"{url}/admin/{'undrain' if undo else 'drain'}", key, body)
    end = time.monotonic() + wait_s
    while status == 200 and not undo and answer.get("drain") != "drained" and time.monotonic() < end:
        time.sleep(0.2)
        answer["drain"] = worker_state(url, address, key).get("drain")
    return status, answer


def api_key(args) -> str | None:
    return open(args.api_key_file).read().strip() if args.api_key_file else os.environ.get("PDSERVE_API_KEY")


def answered(name: str, url: str, call) -> dict | None:
    """``call()``'s answer, printed; None after saying why there is none (the router silent, or not 200)."""
    try:
        status, answer = call()
    except OSError as e:
        print(f"pdserve {name}: the router at {url} does not answer: {e}", file=sys.stderr)
        return None
    if status != 200:
        print(f"pdserve {name}: {status}: {(answer.get('error') or {}).get('message', answer)}", file=sys.stderr)
        return None
    print(json.dumps(answer))
    return answer


def run(args) -> int:
    key = api_key(args)
    answer = answered("drain", args.url, lambda: drain(args.url, args.worker, key, args.force, args.wait, args.undo))
    if answer is None:
        return 1
    return 0 if args.undo or not args.wait or answer.get("drain") == "drained" else 1
