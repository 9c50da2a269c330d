"""``--rebalance``: the router moves decoding requests off a decode worker that is short of KV blocks or whose steps
break the TPOT SLO it serves, onto one with room (``router.migration``, reason ``rebalance``).

Every ``PASS_S`` it looks at the decode workers in the picks, as their heartbeats describe them: the share of their
KV blocks in use (``kv_blocks``, ``kv_blocks_free``) and, where they serve a TPOT SLO (``--slo-tpot-ms``), their
recent decode step (``step_base_ms``). A worker is pressed when its blocks are ``HIGH`` or more in use, or KV waits
there for blocks, or its decode step is over its SLO while it decodes; a worker has room when its blocks are at most ``LOW`` in use
and its step (where known) is under ``ROOM_OF_SLO`` of the SLO. Each pressed worker gives one request a pass to the
roomiest worker: the one with the shortest prompt (the cheapest to move, as Llumnix picks), not moving already. A
worker that just gave one waits ``COOLDOWN_S`` (its heartbeat must show the move first), so moves do not overshoot
or flap."""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)
PASS_S = 0.5
HIGH, LOW = 0.9, 0.7
ROOM_OF_SLO = 0.8
COOLDOWN_S = 2.0


def used(worker) -> float | None:
    info = worker.info
    blocks, free = info.get("kv_blocks"), info.get("kv_blocks_free")
    if not blocks or free is None:
        return None
    return 1.0 - free / blocks


def step_over(worker, share_of_slo: float = 1.0) -> bool:
    """Its recent decode step is over ``share_of_slo`` of the TPOT SLO it serves, while it decodes something (an idle
    worker's last step, from its warm-up say, is no load: on 2 cores four workers' warm-up steps read 160-250 ms)."""
    info = worker.info
    slo, step = info.get("slo_tpot_ms"), info.get("step_base_ms")
    return bool(slo and step and info.get("active") and step > share_of_slo * slo)


def pressed(worker) -> bool:
    share = used(worker)
    return (share is not None and share >= HIGH) or bool(worker.info.get("waiting")) or step_over(worker)


def roomy(worker) -> bool:
    share = used(worker)
    return share is not None and share <= LOW and not step_over(worker, ROOM_OF_SLO)


def plan(workers: list, runs: list, movable, cooling: dict, now: float) -> list[tuple]:
    """``(run, target)`` moves for this pass: one from each pressed worker (not cooling down) to the roomiest."""
    targets = sorted((w for w in workers if roomy(w)), key=lambda w: used(w))
    moves = []
    for source in workers:
        if not targets or not pressed(source) or cooling.get(source.address, 0.0) > now:
            continue
        candidates = [r for r in runs if r.where is source and movable(r)]
        if not candidates:
            continue
        run = min(candidates, key=lambda r: r.first.get("prompt_tokens") or 0)
        target = next((t for t in targets if t is not source), None)
        if target is not None:
            moves.append((run, target))
    return moves


class Rebalancer:
    def __init__(self, service, groups: dict):
        self.service, self.groups = service, groups
        self.cooling: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PASS_S)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - a pass that fails leaves the requests where they are
                log.exception("rebalancing pass failed")

    async def step(self) -> None:
        group = self.groups.get("decode")
        if group is None:
            return
        now = time.monotonic()
        migrations = self.service.migrations
        runs = list(self.service.waits.runs.values())
        for run, target in plan(group.healthy(), runs, migrations.movable, self.cooling, now):
            if await migrations.start(run, target, "rebalance"):
                self.cooling[run.where.address] = now + COOLDOWN_S
