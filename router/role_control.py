"""``--roles auto``: the router moves mixed workers' roles with the load (``router.roles`` makes each change).

Every ``PASS_S`` it reads the pressure on each side, as the router's other decisions read it:
- prompts: the least busy prefill worker in the picks would make a new prompt wait longer than
  ``--disagg-prefill-wait-ms`` (its uncached prompt tokens in flight times its prompt time a token, ``router.disagg``'s
  estimate), or, before any prompt time is known, every prefill worker has ``--disagg-prefill-queue`` prompts in
  flight;
- decoding: a decode worker in the picks is pressed as ``--rebalance`` sees it (90% of its KV blocks in use, KV
  waiting for blocks, or its decode step over the TPOT SLO it serves).
First, each worker still serving both sides is settled, one a pass, with no hold or cooldown: to the side pressed
alone, else to the side fewer workers serve alone (decode on a tie): a mixed worker's prompt steps break the TPOT SLO
of what it decodes, and waiting for pressure left 4x H200 with mixed workers for the first 64 s of a 120 s run.
Then, with a plan (``--roles-profile``, ``router.role_plan``: the split the planner's model serves best for the
last 20 s of traffic), one worker a cooldown moves toward the plan's goal while it has one. Without, or while the
plan has no goal: one side pressed for ``HOLD`` passes in a row while the other is not: one mixed worker takes its role toward it
(``prefill`` for prompts, ``decode`` for decoding; a worker serving both sides before one serving the other), then
nothing changes for ``COOLDOWN_S`` (the next heartbeats must show the change first). Both sides pressed, or neither:
no change. A change the roles refuse (it would leave a group with no worker) is skipped, and the cooldown follows it
as a change. The steps lead to a split of prefill and decode workers and never into ``mixed``: on GPUs a mixed
worker's prompt steps break the TPOT SLO of what it decodes, and a controller that rested there lost to a fixed 3P1D
(bench/RESULTS.md, roles under a shifting load). Under ``--disagg always`` the last decode worker, if mixed, gets no
prompts (a prompt may not go to the worker that decodes it): it serves as a decode worker."""
from __future__ import annotations

import asyncio
import logging
import time

from .errors import ApiError
from .rebalance import pressed

log = logging.getLogger(__name__)
PASS_S = 1.0
HOLD = 3
COOLDOWN_S = 10.0
TOWARD = {"prompts": "prefill", "decoding": "decode"}
FIRST = {"prompts": ("mixed", "decode"), "decoding": ("mixed", "prefill")}  # who changes first, toward each side


def pick(roles: dict, side: str) -> tuple[str, str] | None:
    """``(address, new role)``: one of the mixed workers (``roles``: address -> its role now) to the role serving
    ``side`` ("prompts" or "decoding"), one serving both sides first; None where none can change."""
    for now in FIRST[side]:
        for address in sorted(a for a, r in roles.items() if r == now):
            return address, TOWARD[side]
    return None


def prompts_pressed(prefill_workers: list, policy) -> bool:
    if not prefill_workers:
        return False
    per_token = [w.prompt_ms_per_token() for w in prefill_workers]
    if None in per_token:
        return min(w.outstanding for w in prefill_workers) >= policy.prefill_queue
    return min(w.prefill_wait_ms() for w in prefill_workers) > policy.prefill_wait_ms


class RoleControl:
    def __init__(self, roles, groups: dict, policy, plan=None):
        self.roles, self.groups, self.policy, self.plan = roles, groups, policy, plan  # plan: router.role_plan
        self.held = {"prompts": 0, "decoding": 0}
        self.quiet_until = 0.0

    def mixed(self) -> dict:
        """address -> role now, of every mixed worker (one in both groups)."""
        both = {c.address for c in self.groups["prefill"].clients} & {c.address for c in self.groups["decode"].clients}
        return {a: self.roles.current(a) for a in both}

    def pressure(self) -> dict:
        prefill, decode = (self.groups[r].healthy() for r in ("prefill", "decode"))
        return {"prompts": prompts_pressed(prefill, self.policy), "decoding": any(pressed(w) for w in decode)}

    def unsettled(self, hot: dict) -> tuple[str, str] | None:
        """``(address, role)`` for the first worker still serving both sides: the side pressed alone, else the side
        fewer workers serve alone (decode on a tie); None when none serves both, or while the side it would leave has
        no other worker in the picks (workers still starting: the change would be refused)."""
        roles = self.mixed()
        both = sorted(a for a, r in roles.items() if r == "mixed")
        if not both:
            return None
        healthy = {role: [c.address for c in self.groups[role].healthy()] for role in ("prefill", "decode")}
        if hot["prompts"] != hot["decoding"]:
            role = TOWARD["prompts" if hot["prompts"] else "decoding"]
        else:
            alone = {r: sum(1 for a in healthy[r] if roles.get(a, r) == r) for r in healthy}
            role = "prefill" if alone["prefill"] < alone["decode"] else "decode"
        left = "decode" if role == "prefill" else "prefill"
        return (both[0], role) if any(a != both[0] for a in healthy[left]) else None

    async def step(self, now: float) -> tuple[str, str] | None:
        """One pass; the change made, if any."""
        hot = self.pressure()
        if now >= self.quiet_until and (settle := self.unsettled(hot)) is not None:
            return await self.change(settle, now, "settled", cooldown=False)
        if self.plan is not None:
            roles = self.mixed()
            current = sum(1 for r in roles.values() if r == "prefill")
            target = await self.plan.decide(now, self.fixed(roles), len(roles), current)
            if target is not None:  # the plan decides while it has a goal, not the pressure
                self.held = {s: 0 for s in self.held}
                return await self.toward(target, current, roles, now)
        for side in self.held:
            self.held[side] = self.held[side] + 1 if hot[side] and not any(hot[o] for o in hot if o != side) else 0
        if now < self.quiet_until:
            return None
        side = next((s for s, n in self.held.items() if n >= HOLD), None)
        change = pick(self.mixed(), side) if side else None
        if change is None:
            return None
        return await self.change(change, now, f"{side} pressed for {self.held[side]} passes")

    def fixed(self, roles: dict) -> tuple[int, int]:
        """The workers in the prefill and in the decode picks that were started with their role (not in ``roles``)."""
        return tuple(sum(1 for c in self.groups[r].healthy() if c.address not in roles) for r in ("prefill", "decode"))

    async def toward(self, target: int, current: int, roles: dict, now: float) -> tuple[str, str] | None:
        """One mixed worker a step toward ``target`` of them prefilling (none at the goal or in the cooldown)."""
        if target == current or now < self.quiet_until:
            return None
        change = pick(roles, "prompts" if target > current else "decoding")
        return await self.change(change, now, f"the plan's goal, {target} of {len(roles)} prefilling") if change else None

    async def change(self, change: tuple[str, str], now: float, why: str, cooldown: bool = True):
        """Makes ``change``; the change made, or None where the roles refused it (it would leave a group empty: not
        this change, nor any for a cooldown)."""
        try:
            await self.roles.set(*change)
        except ApiError as e:
            log.info("roles auto: %s to %s not made: %s", *change, e.message)
            change, cooldown = None, True
        else:
            log.info("roles auto: %s: %s is now %s", why, *change)
        self.held = {s: 0 for s in self.held}
        if cooldown:
            self.quiet_until = now + COOLDOWN_S
        return change

    async def run(self) -> None:
        if "prefill" not in self.groups or "decode" not in self.groups:
            return
        try:
            while True:
                await asyncio.sleep(PASS_S)
                try:
                    await self.step(time.monotonic())
                except Exception:  # noqa: BLE001 - a pass that fails changes nothing
                    log.exception("roles auto: a pass failed")
        finally:
            if self.plan is not None:
                self.plan.close()
