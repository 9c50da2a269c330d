"""``--roles auto`` (``router.role_control``) decides on the router's own view of the workers: a worker serving both
sides is settled to one at once; then a side pressed for
``HOLD`` passes in a row while the other is not moves one mixed worker to the role serving it (one serving both
sides first, none into ``mixed``), nothing changes while both or neither are pressed or during the cooldown, and
a change that would leave a group with no worker is skipped. Real ``Drains`` and ``Roles`` over stand-ins for the router's worker clients."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.disagg import DisaggPolicy
from router.drain import Drains
from router.metrics import Metrics
from router.role_control import COOLDOWN_S, HOLD, RoleControl, pick
from router.roles import Roles


class Client:
    def __init__(self, address: str, role: str):
        self.address, self.role, self.info = address, role, {"role": role, "kv_blocks": 100, "kv_blocks_free": 90}
        self.draining, self.healthy, self.outstanding, self.owned = False, True, 0, set()
        self.prompt_tokens_out: dict = {}

    @property
    def leaving(self) -> bool:
        return self.draining

    @property
    def drain_state(self) -> str:
        return "drained" if self.draining else "serving"

    def prompt_ms_per_token(self):
        return 1.0

    def prefill_wait_ms(self, per_token=None):
        return sum(self.prompt_tokens_out.values()) * 1.0


class Group:
    def __init__(self, role: str, clients: list):
        self.role, self.clients = role, clients

    def healthy(self, avoid=()):
        return [c for c in self.clients if c.healthy and not c.leaving]


def cluster():
    """A plain prefill worker, a plain decode worker and a mixed one (a client in each group, as the router has)."""
    p, d, mp, md = Client("p", "prefill"), Client("d", "decode"), Client("m", "mixed"), Client("m", "mixed")
    groups = {"prefill": Group("prefill", [p, mp]), "decode": Group("decode", [d, md])}
    service = SimpleNamespace(waits=SimpleNamespace(runs={}))
    roles = Roles(Drains(service, groups), Metrics())
    return RoleControl(roles, groups, DisaggPolicy(mode="auto")), p, d, mp, md


def press_prompts(*clients, on=True):
    for c in clients:
        c.prompt_tokens_out = {"x": 2000} if on else {}


def press_decoding(*clients, on=True):
    for c in clients:
        c.info["kv_blocks_free"] = 5 if on else 90


def test_a_worker_serving_both_sides_changes_first_and_none_becomes_mixed():
    assert pick({"b": "mixed", "a": "decode"}, "prompts") == ("b", "prefill")
    assert pick({"a": "decode"}, "prompts") == ("a", "prefill")
    assert pick({"c": "prefill"}, "prompts") is None
    assert pick({"c": "prefill", "b": "mixed"}, "decoding") == ("b", "decode")
    assert pick({"c": "prefill"}, "decoding") == ("c", "decode")


def test_a_worker_serving_both_sides_is_settled_at_once_toward_the_side_pressed_or_the_fewer():
    """No hold and no cooldown: each worker serving both sides goes, a pass each, to the side pressed alone, else to
    the side fewer workers serve alone (decode on a tie), and the pressure rules take over from there."""
    async def main():
        control, p, d, mp, md = cluster()
        assert await control.step(0.0) == ("m", "decode")  # one prefill, one decode worker: a tie
        control, p, d, mp, md = cluster()
        p.healthy = False  # no worker serves prompts alone
        assert await control.step(0.0) == ("m", "prefill")
        control, p, d, mp, md = cluster()
        d.healthy = p.healthy = False  # still starting: m is each side's only worker, nothing is asked of it yet
        assert await control.step(0.0) is None and control.quiet_until == 0.0
        d.healthy = True
        assert await control.step(1.0) == ("m", "prefill")
        control, p, d, mp, md = cluster()
        press_prompts(p, mp)
        assert await control.step(0.0) == ("m", "prefill")
        assert await control.step(1.0) is None and control.quiet_until == 0.0  # settled; pressure needs HOLD passes
    asyncio.run(main())


def test_sustained_one_sided_pressure_moves_a_mixed_worker_and_then_waits():
    async def main():
        control, p, d, mp, md = cluster()
        assert await control.step(50.0) == ("m", "decode")  # settled first
        press_prompts(p, mp)
        now = 100.0
        for i in range(HOLD - 1):
            assert await control.step(now + i) is None
        assert await control.step(now + HOLD) == ("m", "prefill")
        assert control.roles.current("m") == "prefill" and md.draining and not mp.draining
        press_decoding(d)
        press_prompts(p, mp, on=False)  # now decoding is pressed: nothing during the cooldown
        for i in range(HOLD + 1):
            assert await control.step(now + HOLD + 1 + i) is None
        assert await control.step(now + HOLD + COOLDOWN_S + 1) == ("m", "decode")
        assert control.roles.current("m") == "decode" and not md.draining and mp.draining
    asyncio.run(main())


def test_both_sides_pressed_or_a_group_left_empty_changes_nothing(caplog):
    """A refused change is asked again only after the cooldown (it was asked, and logged, every pass)."""
    async def main():
        control, p, d, mp, md = cluster()
        press_prompts(p, mp)
        press_decoding(d, md)
        assert await control.step(0.0) == ("m", "decode")  # settled: both pressed, a tie of one worker a side
        for i in range(1, 2 * HOLD):
            assert await control.step(float(i)) is None
        press_prompts(p, mp, on=False)
        d.healthy = False  # the mixed worker is the only decode worker in the picks: it may not leave decoding
        control.roles.drains.groups["decode"].clients[1].info["kv_blocks_free"] = 90
        press_prompts(p, mp)
        for i in range(HOLD + int(COOLDOWN_S) - 1):  # the refusal at pass HOLD, none in the cooldown after it
            assert await control.step(10.0 + i) is None
        assert control.roles.current("m") == "decode"
    with caplog.at_level("INFO", logger="router.role_control"):
        asyncio.run(main())
    assert sum("not made" in r.getMessage() for r in caplog.records) == 1
