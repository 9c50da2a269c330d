"""Rank 0's collection of a tensor-parallel prefill group's KV push reports: a failed or late report fails the push;
a follower silent on two pushes in a row is taken as stuck (the worker then exits and is restarted)."""
import threading
from types import SimpleNamespace

import pytest

from kvtransfer import TransferError
from prefill.tp_kv import STUCK_AFTER, GroupPushes


class Plan:
    def __init__(self):
        self.sent, self.on_report = [], None

    def send(self, op, **fields):
        self.sent.append((op, fields))


def pushes(size=3):
    plan, stuck = Plan(), []
    engine = SimpleNamespace(group=SimpleNamespace(plan=plan, size=size), stage=None)
    return GroupPushes(engine, on_stuck=stuck.append), plan, stuck


def push(group, plan, rid, ranks, ok=True):
    group.start(rid, ["tcp://d0", "tcp://d1"], [0, 1], 20, False)
    for rank in ranks:
        plan.on_report({"rid": rid, "rank": rank, "ok": ok, **({} if ok else {"error": "refused"})})


def test_reports_of_every_follower_end_the_push():
    group, plan, stuck = pushes()
    push(group, plan, "a", [1, 2])
    assert [r["rank"] for r in group.wait("a", 1.0)] == [1, 2] and plan.sent[0][0] == "kv_push"
    push(group, plan, "b", [2, 1], ok=False)
    with pytest.raises(TransferError, match="rank 2: refused"):
        group.wait("b", 1.0)
    assert stuck == []


def test_a_follower_silent_on_pushes_in_a_row_is_stuck():
    group, plan, stuck = pushes()
    for i in range(STUCK_AFTER):
        push(group, plan, f"r{i}", [2])  # rank 1 never answers
        with pytest.raises(TransferError, match="1 ranks did not report"):
            group.wait(f"r{i}", 0.05)
        assert stuck == ([1] if i == STUCK_AFTER - 1 else [])


def test_one_late_report_is_not_stuck_when_the_next_push_is_answered():
    group, plan, stuck = pushes(size=2)
    push(group, plan, "late", [])
    with pytest.raises(TransferError):
        group.wait("late", 0.05)
    push(group, plan, "next", [])
    threading.Timer(0.05, plan.on_report, args=({"rid": "next", "rank": 1, "ok": True},)).start()
    assert len(group.wait("next", 2.0)) == 1
    push(group, plan, "again", [])
    with pytest.raises(TransferError):
        group.wait("again", 0.05)
    assert stuck == []  # silent once, answered, silent once: never twice in a row


def test_a_stuck_rank_fails_the_workers_requests_as_retryable_and_exits_for_a_restart(monkeypatch):
    from control import worker as worker_module

    failed, exits, pongs = [], [], []
    fake = SimpleNamespace(role="prefill", reply_to={"r1": 0, "r2": 0}, peers=[b"router"], draining_since=None,
                           server=SimpleNamespace(send=lambda *a, **k: pongs.append(a)), describe=lambda: {},
                           fail=lambda rid, status, msg, stage: failed.append((rid, status, stage, msg)))
    fake._give_up = lambda msg, stage: worker_module.WorkerLoop._give_up(fake, msg, stage)
    monkeypatch.setattr(worker_module.os, "_exit", exits.append)
    monkeypatch.setattr(worker_module.time, "sleep", lambda s: None)
    worker_module.WorkerLoop._rank_stuck(fake, 1)
    assert fake.draining_since is not None and pongs  # out of the routers' picks first
    assert [(rid, status, stage) for rid, status, stage, _ in failed] == [("r1", 503, "tp_rank_lost"),
                                                                           ("r2", 503, "tp_rank_lost")]
    assert "stuck in a KV transfer" in failed[0][3] and exits == [70]
