"""Draining a worker from the router (``POST /admin/drain``, ``pdserve drain``), and undraining it.

A drained worker leaves the picks at once: no new request goes to it. While it holds requests, a loop moves each
one that is decoding there to the least loaded other worker of its group (``router.migration``, reason ``drain``),
two at a time, the shortest first (on 2x H200, 16 moves asked at once queued behind one another: seconds of stall);
requests still waiting for their prompt or their KV there are moved once they decode. A colocated worker has no KV
transport: its requests end where they are. ``/health`` shows each worker's ``drain`` state: ``serving``,
``draining`` while it holds requests the router gave it, ``drained`` once it holds none (then it can be stopped
without ending a stream). ``undrain`` puts it back in the picks.

Draining the last worker of a role in the picks would leave requests nowhere to go: refused (409) unless
``force``. An address no group knows is a 404."""
from __future__ import annotations

import asyncio
import logging

from .errors import ApiError

log = logging.getLogger(__name__)
PASS_S = 0.1  # between two looks for requests to move
MOVE_TRIES = 2  # a request whose move failed this often stays where it is
IN_FLIGHT = 2  # moves off one drained worker at a time


class Drains:
    def __init__(self, service, groups: dict):
        self.service, self.groups = service, groups
        self.tasks: dict[str, asyncio.Task] = {}
        self.tries: dict[str, int] = {}

    def find(self, address: str) -> list:
        """``(group, client)`` of every group that has the worker (a mixed worker is in two)."""
        found = [(g, c) for g in self.groups.values() for c in g.clients if c.address == address]
        if not found:
            known = sorted({c.address for g in self.groups.values() for c in g.clients})
            raise ApiError(404, f"no worker {address!r}; the router knows {known}", param="worker")
        return found

    async def drain(self, address: str, force: bool = False, roles: tuple | None = None) -> dict:
        """``roles``: only the worker's clients in those groups (``router.roles``: a mixed worker leaving one)."""
        found = [(g, c) for g, c in self.find(address) if roles is None or g.role in roles]
        client = next((c for g, c in found if g.role == "decode"), found[0][1])  # whose requests decode there
        for group, own in found:
            others = [c for c in group.clients if c is not own and c.healthy and not c.leaving]
            if not others and not own.draining and not force:
                raise ApiError(409, f"{address} is the last {group.role} worker in the picks: draining it would leave "
                                    f"{group.role} requests nowhere to go (send \"force\": true to drain it anyway)",
                               param="worker", code="last_worker")
        for _, own in found:  # a mixed worker has a client in each group
            own.draining = True
        if address not in self.tasks or self.tasks[address].done():
            self.tasks[address] = asyncio.create_task(self._loop(client))
        log.info("draining %s worker %s (%d requests on it)", client.role, address, client.outstanding)
        return self.describe(client)

    def undrain(self, address: str, roles: tuple | None = None) -> dict:
        found = [(g, c) for g, c in self.find(address) if roles is None or g.role in roles]
        for _, own in found:
            own.draining = False
        task = self.tasks.get(address)
        if task is not None and not any(c.draining for _, c in self.find(address)):
            self.tasks.pop(address).cancel()
        return self.describe(next((c for g, c in found if g.role == "decode"), found[0][1]))

    @staticmethod
    def describe(client) -> dict:
        return {"worker": client.address, "role": client.role, "drain": client.drain_state,
                "outstanding": max(0, client.outstanding)}

    async def _loop(self, client) -> None:
        """Move what decodes on ``client`` elsewhere until it holds nothing (or is undrained): at most
        ``IN_FLIGHT`` moves at a time, the shortest contexts first, so that a paused stream waits for its own push
        and not for a queue of others' (the rest decode on meanwhile)."""
        try:
            while client.draining and client.drain_state == "draining":
                runs = [r for r in list(self.service.waits.runs.values()) if r.where is client]
                moving = sum(1 for r in runs if r.move is not None)
                for run in sorted(runs, key=lambda r: (r.first or {}).get("prompt_tokens") or 0):
                    if moving >= IN_FLIGHT:
                        break
                    moving += await self._move(run, client)
                await asyncio.sleep(PASS_S)
        except Exception:  # noqa: BLE001 - a drain that stops moving leaves its requests to end where they are
            log.exception("draining %s stopped", client.address)

    async def _move(self, run, client) -> bool:
        """Whether a move of ``run`` began."""
        migrations, decode = self.service.migrations, self.groups.get("decode")
        if decode is None or not migrations.movable(run) or self.tries.get(run.attempt_rid, 0) >= MOVE_TRIES:
            return False
        targets = [c for c in decode.healthy(avoid={client}) if c is not client]
        if not targets:
            return False
        target = min(targets, key=lambda c: c.outstanding)
        self.tries[run.attempt_rid] = self.tries.get(run.attempt_rid, 0) + 1
        if len(self.tries) > 10_000:  # ended requests' counts
            self.tries.clear()
        return await migrations.start(run, target, "drain")
