"""Roles at runtime (``POST /admin/role {"worker", "role", "force"}``, ``pdserve role``).

A mixed worker (``pdserve up --mixed N``, ``decode.mixed``) is both a prefill and a decode worker of the router,
with its weights loaded once. Its role is the groups whose picks it is in: ``prefill`` (out of the decode picks, and
what decodes on it moves to the other decode workers as a drain moves it: ``router.drain``), ``decode`` (out of the
prefill picks; prompts it is computing finish) or ``mixed`` (both). A change takes effect at once, without a
restart. Workers started as prefill or decode keep their role: a change asked of one is refused (409) naming the
role it was started with, as is leaving the last worker of a group unless ``force`` (the drain's rule). Counted in
``pdserve_role_changes_total{role}``; ``/health`` lists each worker's ``drain`` state per group."""
from __future__ import annotations

import logging

from .errors import ApiError

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "mixed")
SERVES = {"prefill": ("prefill",), "decode": ("decode",), "mixed": ("prefill", "decode")}


class Roles:
    def __init__(self, drains, metrics):
        self.drains, self.metrics = drains, metrics

    def clients(self, address: str) -> dict:
        """The worker's client in each group (404 for an unknown address, 409 for a worker that is not mixed)."""
        found = {g.role: c for g, c in self.drains.find(address)}
        if set(found) != {"prefill", "decode"}:
            started = next(iter(found))
            raise ApiError(409, f"{address} was started as a {started} worker; only mixed workers (pdserve up --mixed N) "
                                f"change roles at runtime", param="worker", code="not_mixed")
        return found

    def current(self, address: str) -> str:
        serving = [r for r, c in self.clients(address).items() if not c.draining]
        return "mixed" if len(serving) == 2 else serving[0] if serving else "none"

    async def set(self, address: str, role: str, force: bool = False) -> dict:
        if role not in ROLES:
            raise ApiError(400, f"no role {role!r}: use one of {', '.join(ROLES)}", param="role")
        clients, before = self.clients(address), self.current(address)
        leave = tuple(r for r in clients if r not in SERVES[role])
        if leave:
            await self.drains.drain(address, force, roles=leave)
        self.drains.undrain(address, roles=SERVES[role])
        if role != before:
            self.metrics.role_changes.labels(role).inc()
            log.info("worker %s: role %s -> %s", address, before, role)
        return self.describe(address)

    def describe(self, address: str) -> dict:
        clients = self.clients(address)
        return {"worker": address, "role": self.current(address),
                **{f"{r}_drain": c.drain_state for r, c in clients.items()}}
