"""Start-up that cannot collide, and clusters that do not outlive whoever started them.

No process is told a port to bind later (``control.listen``): two ``pdserve up`` started at once on one host, with
their workers' default ports, both come up, every time. And a cluster is tied to the process that started it
(``control.lifetime``): a test runner killed mid-test, by SIGTERM or SIGKILL, leaves no pdserve process behind."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from deploy.local import Cluster, alive, children_of

ROOT = Path(__file__).resolve().parents[1]


def completes(url: str) -> bool:
    body = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4,
                                                     "temperature": 0}, timeout=60).json()
    return len(body["choices"][0]["text"]) > 0


def test_two_clusters_started_at_once_both_come_up_three_times():
    """Every socket is bound by the process that starts the one that serves it, and handed over: nothing to race
    for, so three rounds show it as well as ten did (each costs six processes' start on two cores)."""
    for _ in range(3):
        pair = [Cluster("--no-warmup"), Cluster("--no-warmup")]
        try:
            for cluster in pair:
                cluster.wait_ready()
            assert pair[0].url != pair[1].url
            assert all(completes(cluster.url) for cluster in pair)
        finally:
            left = [cluster.stop()[1] for cluster in pair]
        assert left == [[], []]


INNER = '''
import os, time
from deploy.local import Cluster, children_of

def test_holds_a_cluster():
    cluster = Cluster("--no-warmup").wait_ready()
    pids = [cluster.proc.pid, *children_of(cluster.proc.pid)]
    with open({path!r} + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace({path!r} + ".tmp", {path!r})
    time.sleep(600)
'''


def wait_for(predicate, seconds: float, every: float = 0.2) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


@pytest.mark.parametrize("victim", ["pytest-SIGTERM", "pytest-SIGKILL", "up-SIGKILL"])
def test_a_killed_starter_leaves_no_pdserve_process(tmp_path, victim):
    """A pytest process that started a cluster is killed (or ``up`` itself, by SIGKILL, which it cannot handle):
    ``up``, the router and the workers all exit."""
    pidfile = tmp_path / "pids"
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER.format(path=str(pidfile))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(pidfile.exists, 180), "the inner test's cluster did not come up"
        pids = [int(p) for p in pidfile.read_text().split()]
        pids += [kid for pid in pids for kid in children_of(pid)]  # the workers' own children, if any
        assert len(pids) >= 4 and all(alive(pid) for pid in pids)  # up, router, prefill, decode
        if victim == "up-SIGKILL":
            os.kill(pids[0], signal.SIGKILL)
        else:
            runner.send_signal(signal.SIGTERM if victim == "pytest-SIGTERM" else signal.SIGKILL)
            runner.wait(30)
        assert wait_for(lambda: not any(alive(pid) for pid in pids), 60), [p for p in pids if alive(p)]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
