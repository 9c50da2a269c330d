"""The router's workers: one client per worker address and role, grouped by role, and the membership a
deployment keeps current in ``workers_file`` (re-read every second)."""
from __future__ import annotations

import asyncio
import json
import logging

from .config import RouterConfig
from .policy import make_policy
from .workers import WorkerClient, WorkerGroup

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "colocated")


def worker_client(cfg: RouterConfig, role: str, address: str, inboxes: dict, token: bytes | None) -> WorkerClient:
    return WorkerClient(address, role, inboxes, cfg.heartbeat_s, cfg.dead_after_s, token, cfg.stale_after_s)


def worker_groups(cfg: RouterConfig, inboxes: dict, token: bytes | None) -> dict:
    groups = {}
    for role in ROLES:
        clients = [worker_client(cfg, role, a, inboxes, token) for a in getattr(cfg, role)]
        groups[role] = WorkerGroup(role, clients, make_policy(cfg.policy, cfg.kv_weight))
    return groups


class Membership:
    """Workers from ``workers_file`` (a deployment keeps it current): new addresses are connected, vanished ones
    closed (their requests fail over as when a worker dies)."""

    def __init__(self, cfg: RouterConfig, groups: dict, inboxes: dict, token: bytes | None):
        self.cfg, self.groups, self.inboxes, self.token = cfg, groups, inboxes, token
        self._seen = None

    def read(self) -> dict | None:
        try:
            with open(self.cfg.workers_file) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        return {role: [a for a in data.get(role) or [] if isinstance(a, str) and a.startswith("tcp://")]
                for role in ROLES}

    def apply(self, ctx, wanted: dict) -> None:
        for role, addrs in wanted.items():
            group = self.groups[role]
            for client in [c for c in group.clients if c.address not in addrs]:
                log.info("%s worker %s left the deployment", role, client.address)
                client.fail_owned(f"{role} worker {client.address} left the deployment")
                client.close()
                group.clients.remove(client)
            known = {c.address for c in group.clients}
            for addr in addrs:
                if addr not in known:
                    log.info("%s worker %s joined the deployment", role, addr)
                    client = worker_client(self.cfg, role, addr, self.inboxes, self.token)
                    client.start(ctx)
                    group.clients.append(client)

    async def watch(self, ctx) -> None:
        while True:
            wanted = self.read()
            if wanted is not None and wanted != self._seen:
                self.apply(ctx, wanted)
                self._seen = wanted
            await asyncio.sleep(1.0)
