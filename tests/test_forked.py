"""``pdserve up`` forks its torch workers from itself after importing torch once (``deploy.forked``): each worker
is what an exec'd one would be (its own command line, descriptors and exit code) and never runs ``up``'s code."""
import os
import subprocess
import sys
import textwrap

import httpx

from deploy.forked import argv_of
from deploy.local import Cluster

BASE = [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]


def run_script(script: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (a single-threaded process, as ``up`` is; a test runner's is not)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_only_workers_started_by_a_single_threaded_process_are_forked():
    run_script(f"""
        import threading
        from deploy.forked import forkable
        base = {BASE!r}
        assert forkable(base + ["decode", "--port", "0"])
        assert forkable(base + ["prefill", "--port", "0"])
        assert not forkable(base + ["router", "--port", "0"])
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        assert not forkable(base + ["decode", "--port", "0"])
        stop.set()
        t.join()
    """)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` holds a listening socket of (its descriptors against /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_up_forks_each_worker_with_its_own_command_line_and_only_its_own_sockets():
    cluster = Cluster("--decode", "2").wait_ready()
    try:
        health = httpx.get(cluster.url + "/health").json()
        router_port = int(cluster.url.rsplit(":", 1)[1])
        workers = [(role, w) for role in ("prefill", "decode") for w in health["workers"][role]]
        assert len(workers) == 3
        for role, w in workers:
            pid, port = w["pid"], int(w["address"].rsplit(":", 1)[1])
            with open(f"/proc/{pid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[1]) == cluster.proc.pid  # up's child
            argv = argv_of(pid)
            assert role in argv and argv[argv.index("--port") + 1] == str(port), argv
            held = listening_ports(pid)
            assert port in held and router_port not in held, (role, held)
            others = {int(x["address"].rsplit(":", 1)[1]) for _, x in workers if x is not w}
            assert not held & others, (role, held, others)
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        _, survivors = cluster.stop()
    assert not survivors


def test_a_forked_worker_that_fails_exits_with_its_code_and_never_returns_into_its_starter(tmp_path):
    """A worker that cannot start (no such model) exits 1 through the supervisor's fork, and the code after the
    fork runs once: in the starter, not again in the child."""
    marks = tmp_path / "marks"
    run_script(f"""
        import os, sys
        from deploy import forked
        from deploy.supervise import Child
        cmd = {BASE!r} + ["decode", "--port", "0", "--model", {str(tmp_path / "missing")!r}, "--no-warmup"]
        child = Child("decode worker 0", cmd, dict(os.environ))
        child.start()
        with open({str(marks)!r}, "a") as f:  # every process that returns from start() leaves a line
            f.write(f"{{os.getpid()}}\\n")
        assert isinstance(child.proc, forked.Forked), type(child.proc)
        assert child.proc.wait(120) == 1, child.proc.returncode
    """)
    assert len(marks.read_text().split()) == 1, marks.read_text()


def test_clusters_of_one_harness_are_forked_by_one_launcher_which_reports_how_each_up_ended():
    run_script("""
        import os, signal
        from deploy.launcher import Launched, Launcher
        from deploy.local import Cluster, children_of
        a, b = Cluster("--colocated", "--no-warmup"), Cluster("--colocated", "--no-warmup")
        assert isinstance(a.proc, Launched) and a.proc.launcher is b.proc.launcher
        launcher = a.proc.launcher.proc.pid
        a.wait_ready(), b.wait_ready()
        assert sorted(children_of(launcher)) == sorted([a.proc.pid, b.proc.pid])
        os.kill(a.proc.pid, signal.SIGKILL)
        assert a.proc.wait(30) == -signal.SIGKILL
        kids, survivors = b.stop()
        assert b.proc.returncode == 0 and len(kids) == 2 and not survivors, (b.proc.returncode, kids, survivors)
        a.stop()
    """, timeout=240)
