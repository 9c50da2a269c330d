"""The router's warm-up of prefill -> decode pairs (``router.warmup``) with fake workers: which pairs, the start-up
gate of /health, failures, and a restarted worker's new pairs."""
import asyncio
from types import SimpleNamespace

import pytest

from router.warmup import PairWarmer


def client(address, transport="nccl", pid=1):
    return SimpleNamespace(address=address, healthy=True, last_pong=1.0, info={"transport": transport, "pid": pid})


class FakeService:
    def __init__(self, groups, fail=()):
        self.groups, self.fail, self.calls = groups, set(fail), []

    def ready(self):
        return all(c.healthy for g in self.groups.values() for c in g.clients)

    async def warm_pair(self, prefill, decode, payload):
        self.calls.append((prefill.address, decode.address, payload["prompt"][0]))
        if (prefill.address, decode.address) in self.fail:
            raise RuntimeError("no route")
        return prefill.address, decode.address


def cluster(prefill, decode, **kw):
    groups = {"prefill": SimpleNamespace(clients=prefill), "decode": SimpleNamespace(clients=decode)}
    service = FakeService(groups, **kw)
    return PairWarmer(service, groups, kw.pop("mode", "auto")), service


def test_every_pair_is_warmed_once_with_a_distinct_prompt_before_the_gate_lifts():
    p0, p1, d0 = client("p0"), client("p1"), client("d0")
    warmer, service = cluster([p0, p1], [d0])
    assert not warmer.status()["ready"] and warmer.status()["pending"] == 2
    asyncio.run(warmer.warm_pending())
    assert [c[:2] for c in service.calls] == [("p0", "d0"), ("p1", "d0")]
    assert len({c[2] for c in service.calls}) == 2  # a prefix cached by the first warm-up is not the second's
    assert warmer.status() == {"warm": 2, "failed": 0, "pending": 0, "ready": True}
    asyncio.run(warmer.warm_pending())
    assert len(service.calls) == 2


def test_a_failed_warm_up_is_counted_and_does_not_hold_the_gate():
    warmer, service = cluster([client("p0")], [client("d0")], fail={("p0", "d0")})
    asyncio.run(warmer.warm_pending())
    assert warmer.status() == {"warm": 0, "failed": 1, "pending": 0, "ready": True}


def test_other_transports_and_never_lift_the_gate_at_once_and_warm_nothing():
    warmer, service = cluster([client("p0", "tcp")], [client("d0", "tcp")])
    asyncio.run(warmer.warm_pending())
    assert service.calls == [] and warmer.status()["ready"]
    warmer, service = cluster([client("p0")], [client("d0")])
    warmer.mode = "never"
    assert warmer.pending() == []


def test_a_worker_that_has_not_answered_yet_holds_the_gate():
    late = client("p1")
    late.healthy, late.last_pong = False, 0.0
    warmer, service = cluster([client("p0"), late], [client("d0")])
    service.ready = lambda: True  # one worker of each role is enough to serve
    asyncio.run(warmer.warm_pending())
    assert not warmer.status()["ready"]
    late.healthy, late.last_pong = True, 2.0
    asyncio.run(warmer.warm_pending())
    assert warmer.status()["ready"] and [c[:2] for c in service.calls] == [("p0", "d0"), ("p1", "d0")]


def test_a_restarted_worker_makes_new_pairs_warmed_while_the_cluster_serves():
    p0, d0 = client("p0"), client("d0")
    warmer, service = cluster([p0], [d0])
    asyncio.run(warmer.warm_pending())
    d0.info["pid"] = 2  # restarted on the same address
    assert warmer.pending() == [(p0, d0)] and warmer.status()["ready"]
    asyncio.run(warmer.warm_pending())
    assert len(service.calls) == 2 and warmer.status()["warm"] == 2


def test_a_mixed_worker_is_not_paired_with_itself():
    both = client("m0")
    warmer, _ = cluster([both, client("m1")], [both])
    assert [(p.address, d.address) for p, d in warmer.pending()] == [("m1", "m0")]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="warm_pairs"):
        PairWarmer(None, {}, "sometimes")
