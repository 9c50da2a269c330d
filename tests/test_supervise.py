"""``pdserve up`` itself keeps serving when a worker dies: the others serve, the dead one comes back."""
import os
import signal
import time

import httpx

from deploy.forked import argv_of
from deploy.local import Cluster, children_of
from deploy.supervise import Child, Supervisor
from tests.streams import StreamClient


def decode_workers(health: dict) -> dict:
    return {w["address"]: w for w in health["workers"]["decode"]}


def decode_pid(cluster: Cluster, port: str | None) -> tuple[int, str]:
    """A decode worker's pid and port, as /health lists them: the one on ``port``, or the first when None."""
    for address, w in decode_workers(httpx.get(cluster.url + "/health").json()).items():
        if port is None or address.endswith(f":{port}"):
            return w["pid"], address.rsplit(":", 1)[1]
    raise AssertionError(f"no decode worker on port {port}")


def wait_restarted(cluster: Cluster, port: str, restarts: int) -> dict:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        w = decode_workers(httpx.get(cluster.url + "/health").json())[f"tcp://127.0.0.1:{port}"]
        if w["healthy"] and w.get("restarts") == restarts:
            return w
        time.sleep(0.3)
    raise AssertionError(w)


def kill_mid_streams(cluster: Cluster, body: dict, port: str | None):
    """Start 6 streams, SIGKILL one decode worker once each has 3 tokens; returns (streams, killed_at, port)."""
    streams = [StreamClient(cluster.url, {**body, "prompt": f"stream {i}"}) for i in range(6)]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_tokens(3)
    victim, port = decode_pid(cluster, port)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for s in streams:
        s.join(60)
    return streams, killed_at, port


def resumed(cluster: Cluster) -> float:
    """Streams the router resumed on another worker after a decode worker was lost."""
    for line in httpx.get(cluster.url + "/metrics").text.splitlines():
        if line.startswith('pdserve_request_retries_total{reason="decode_lost"}'):
            return float(line.split()[-1])
    return 0.0


def test_up_restarts_a_killed_decode_worker_while_the_others_serve():
    cluster = Cluster("--decode", "2").wait_ready()
    try:
        body = {"model": "tiny-llama", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        port, kills = None, 0
        for _ in range(4):  # on a busy machine every stream may end before the kill: kill the same worker again
            streams, killed_at, port = kill_mid_streams(cluster, body, port)
            kills += 1
            # every stream ends with all its tokens: those on the killed worker go on on the other
            assert all(s.finished and not s.error and s.tokens == 900 for s in streams), \
                [(s.tokens, s.error) for s in streams]
            if resumed(cluster):
                break
            wait_restarted(cluster, port, kills)
        assert resumed(cluster) >= 1
        after = httpx.post(cluster.url + "/v1/completions", json={**body, "prompt": "after", "max_tokens": 5}, timeout=30)
        assert after.status_code == 200, after.text
        assert cluster.proc.poll() is None
        w = wait_restarted(cluster, port, kills)
        others = [x for a, x in decode_workers(httpx.get(cluster.url + "/health").json()).items() if a != w["address"]]
        assert [x["restarts"] for x in others] == [0]
        metrics = httpx.get(cluster.url + "/metrics").text
        assert f'pdserve_worker_restarts{{role="decode",worker="tcp://127.0.0.1:{port}"}} {kills}.0' in metrics
        again = [StreamClient(cluster.url, {**body, "prompt": f"again {i}", "max_tokens": 8}) for i in range(4)]
        for s in again:
            s.start()
        for s in again:
            s.join(60)
        assert all(s.finished and not s.error for s in again)
    finally:
        kids, survivors = cluster.stop()
    assert not survivors


def test_killing_the_router_stops_the_cluster():
    cluster = Cluster().wait_ready()
    try:
        router = next(pid for pid in children_of(cluster.proc.pid) if "router" in argv_of(pid))
        os.kill(router, signal.SIGKILL)
        assert cluster.proc.wait(40) == 1
    finally:
        _, survivors = cluster.stop()
    assert not survivors


def test_supervisor_backs_off_and_gives_up(tmp_path):
    sup = Supervisor(max_restarts=2, backoff_s=0.05, max_backoff_s=1.0)
    child = sup.add(Child("flaky", ["python3", "-c", "import sys; sys.exit(3)"], dict(os.environ)))
    end = time.monotonic() + 10
    while not child.given_up and time.monotonic() < end:
        assert sup.check() is None
        time.sleep(0.01)
    assert child.given_up and child.restarts == 2 and child.failures == 2
    fatal = sup.add(Child("router", ["python3", "-c", "pass"], dict(os.environ), restartable=False))
    fatal.proc.wait()
    assert sup.check() is fatal


def test_up_waits_for_every_worker_not_just_the_router():
    from deploy.up import unhealthy_workers
    loading = {"workers": {"prefill": [{"address": "tcp://a", "healthy": True}],
                           "decode": [{"address": "tcp://b", "healthy": False}, {"address": "tcp://c", "healthy": True}]}}
    assert unhealthy_workers(loading) == ["decode tcp://b"]
    assert unhealthy_workers({"workers": {"prefill": [], "decode": []}}) == ["workers to register"]
    ready = {"workers": {"colocated": [{"address": "tcp://a", "healthy": True}]}}
    assert unhealthy_workers(ready) == []


def test_up_shows_its_start_as_a_bar_of_healthy_workers(capsys):
    """The bar counts the workers /health lists as healthy, plus the router's own ready, and names what it waits
    for; the last line of a start that came up reads all of them."""
    from deploy.progress import bar
    from deploy.up import _show

    loading = {"status": "unavailable", "workers": {"prefill": [{"address": "tcp://a", "healthy": True}],
                                                    "decode": [{"address": "tcp://b", "healthy": False}]}}
    up = {"status": "ok", "workers": {role: [{**w, "healthy": True} for w in group]
                                      for role, group in loading["workers"].items()}}
    with bar(desc="starting", unit="worker") as progress:
        _show(progress, loading)
        assert (progress.n, progress.total) == (1, 3)
        assert "decode tcp://b" in progress.postfix
        _show(progress, up)
        assert (progress.n, progress.total) == (3, 3)
    assert "starting: 100%" in capsys.readouterr().err


def test_a_worker_killed_once_the_router_said_ready_is_restarted_not_a_failed_start():
    """``up`` polls the router's /health as clients do, and a client may kill a worker between the router first
    saying ready and ``up``'s next look: the router, one role short, answers 503 but with ``ready_since``, and the
    child is the supervisor's to restart, not a failed start that takes the cluster down. A child that exits
    before the router was ever ready is one."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest

    from deploy.up import wait_ready

    healthy = {"prefill": [{"address": "tcp://a", "healthy": True}], "decode": [{"address": "tcp://b", "healthy": True}]}
    one_short = {**healthy, "decode": [{"address": "tcp://b", "healthy": False}]}
    state = {}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(state["health"]).encode()
            self.send_response(200 if state["health"]["status"] == "ok" else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Killed:  # a decode worker that got SIGKILL
        args, returncode = ["python", "-m", "pdserve", "decode", "--host", "127.0.0.1"], -9

        def poll(self):
            return self.returncode

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        state["health"] = {"status": "unavailable", "ready_since": 1.5e9, "workers": one_short}
        assert wait_ready(url, [Killed()], 5) == state["health"]
        state["health"] = {"status": "unavailable", "ready_since": None, "workers": one_short}
        with pytest.raises(RuntimeError, match="a child exited early: decode"):
            wait_ready(url, [Killed()], 5)
        state["health"] = {"status": "ok", "ready_since": 1.5e9, "workers": healthy}
        assert wait_ready(url, [], 5) == state["health"]
        state["health"] = {"status": "warming", "ready_since": None, "workers": healthy}
        with pytest.raises(TimeoutError, match="warming"):
            wait_ready(url, [], 1)
    finally:
        server.shutdown()
