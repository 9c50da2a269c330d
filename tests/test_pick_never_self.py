"""A disaggregated request's prompt never goes to its own decode worker's prefill side (``Service._pick`` with
``never``): a mixed worker is a client in both groups, and where every other prefill worker is avoided (a retry's
blame) or late on its pong, the soft ``avoid`` alone fell back to the twin, so the worker sent its KV to itself
(over nccl the same-GPU path then failed: "invalid device context")."""
import asyncio

import pytest

from router.errors import ApiError
from router.policy import LeastOutstanding
from router.service import Service
from router.workers import WorkerGroup


class Client:
    def __init__(self, address: str, healthy: bool = True):
        self.address, self.healthy, self.alive, self.suspect_until, self.leaving = address, healthy, healthy, 0.0, False
        self.outstanding = 0


def service(clients) -> Service:
    svc = Service.__new__(Service)
    svc.groups, svc.pick_wait_s = {"prefill": WorkerGroup("prefill", clients, LeastOutstanding())}, 0.1
    return svc


def test_the_twin_is_never_picked_and_an_avoided_worker_comes_before_none():
    twin, other = Client("a"), Client("b")
    svc = service([twin, other])
    assert asyncio.run(svc._pick("prefill", avoid={other}, never={twin})) is other  # avoided, but not itself
    other.healthy = other.alive = False
    with pytest.raises(ApiError) as e:
        asyncio.run(svc._pick("prefill", never={twin}))
    assert e.value.status == 503
    assert asyncio.run(svc._pick("prefill")) is twin  # no rule against it where it is not the decode worker
