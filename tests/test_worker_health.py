"""The router's view of a worker's health, without processes: heartbeat lapses and suspicion after a failed KV
transfer, and the fallback that keeps a loaded cluster serving when every pong is late."""
import time

from router.policy import RoundRobin
from router.workers import SUSPECT_S, WorkerClient, WorkerGroup


def client(name: str, pong_age: float) -> WorkerClient:
    c = WorkerClient(f"tcp://127.0.0.1:{name}", "decode", {}, heartbeat_s=0.25, dead_after_s=3.0, stale_after_s=1.0)
    c.last_pong = time.monotonic() - pong_age
    return c


def test_a_lapsed_heartbeat_leaves_the_picks_at_one_second_and_fails_owned_at_three():
    assert client("1", 0.9).healthy and not client("2", 1.1).healthy
    assert client("3", 2.9).alive and not client("4", 3.1).alive


def test_suspicion_doubles_while_failures_repeat_and_starts_over_after_a_success():
    c = client("1", 0.0)
    c.suspect("refused")
    assert not c.healthy and c.suspect_until - time.monotonic() <= SUSPECT_S
    c.suspect("refused again")
    assert c.suspect_s == 2 * SUSPECT_S
    c.suspect_until = 0.0
    assert c.healthy
    c.vouch()
    assert c.suspect_s == SUSPECT_S


def test_picks_avoid_failed_workers_and_fall_back_when_all_are_late():
    fresh, late, dead = client("1", 0.1), client("2", 1.5), client("3", 5.0)
    group = WorkerGroup("decode", [fresh, late, dead], RoundRobin())
    assert group.healthy() == [fresh]
    assert group.healthy(avoid={fresh}) == [fresh]  # only the avoided one is left: it is still better than none
    fresh.last_pong = time.monotonic() - 1.5
    assert group.healthy() == [fresh, late] and not group.ready()  # all late: the living ones, not the dead
    other = client("4", 0.1)
    group.clients.append(other)
    assert group.pick(avoid={other}) is other and group.ready()
