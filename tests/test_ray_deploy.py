"""``pdserve deploy ray`` on a two-node local Ray cluster (127.0.0.2, 127.0.0.3): prefill pinned to one node and
decode to the other, the openai SDK through it, a decode actor killed mid-stream and restarted, scaled down without
a failed request, and ``down`` leaving nothing behind."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generate import generate_many  # noqa: E402

NAME = f"test-{os.getpid()}"


def cli(*args, timeout=240) -> str:
    out = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "deploy", *args],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": os.environ["HOME"]})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def status(name: str = NAME) -> dict:
    return json.loads(cli("status", "--name", name, "--json"))


def healthy(url, role) -> list:
    try:
        workers = httpx.get(url + "/health", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return []
    return [w for w in workers.get(role, []) if w["healthy"]]


def eventually(check, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.5)
    return False


def processes(wanted) -> list[int]:
    """The pids of processes whose command line (its arguments, as bytes) ``wanted`` accepts."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if wanted(cmd):
            out.append(int(pid))
    return out


def deployment_processes() -> list[int]:
    """pdserve processes started by this deployment's actors (their parent is a Ray worker of this cluster)."""
    return processes(lambda cmd: b"pdserve" in cmd and any(a.startswith(b"--workers-file") or
                                                          a in (b"127.0.0.2", b"127.0.0.3") for a in cmd))


def test_deploy_serve_kill_restart_scale_down(ray_cluster):
    reference = Engine(EngineConfig(threads=1))
    prompt = "The deployment answers"
    want = generate_many(reference, [prompt], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])[0][0]
    cli("ray", "--address", ray_cluster.address, "--name", NAME, "--prefill", "1", "--decode", "2", "--threads", "1",
        "--prefill-resources", '{"node_b": 0.01}', "--decode-resources", '{"node:127.0.0.2": 0.01}', "--port", "0")
    try:
        url = status()["url"]
        assert eventually(lambda: len(healthy(url, "prefill")) == 1 and len(healthy(url, "decode")) == 2, 120)
        actors = {a["name"]: a for a in status()["actors"]}
        assert actors["prefill-0"]["node_ip"] == "127.0.0.3"
        assert {actors["decode-0"]["node_ip"], actors["decode-1"]["node_ip"]} == {"127.0.0.2"}

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want

        # kill one decode actor's process while streams run on both decode workers
        results, victim = [], actors["decode-0"]
        lock = threading.Lock()

        def one(started):
            try:
                n = 0
                for _ in client.completions.create(model="tiny-llama", prompt="long " * 20, max_tokens=900,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    n += 1
                    if n == 3:  # decode has streamed: a kill before that is retried, not an error
                        started.release()
                outcome = ("ok", n)
            except openai.APIError as e:
                outcome = ("error", str(e))
            with lock:
                results.append((outcome, time.monotonic()))

        def holding() -> dict | None:  # the decode worker holding the most of the streams, by the router's count
            workers = healthy(url, "decode")
            best = max(workers, key=lambda w: w.get("outstanding", 0), default=None)
            return best if best and best.get("outstanding", 0) > 0 else None

        for _ in range(5):  # four streams under way, and a worker still decoding some (the streams last about 1.5 s)
            started, seen, results[:] = threading.Semaphore(0), [], []
            threads = [threading.Thread(target=one, args=(started,)) for _ in range(4)]
            for t in threads:
                t.start()
            for _ in threads:  # every stream is under way
                assert started.acquire(timeout=60)
            if eventually(lambda: seen.append(holding()) or seen[-1], 10):
                break
            for t in threads:  # all ended before the router's count was read: again
                t.join(120)
        busiest = seen[-1]
        assert busiest, "no decode worker held a stream in five tries"
        victim = next(a for a in actors.values()
                      if a["name"].startswith("decode") and a.get("process") == busiest["pid"])
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(120)
        # the victim's streams go on on the other decode worker, from their last token
        assert len(results) == 4 and all(r[0][0] == "ok" for r in results), (results, killed_at)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert re.search(r'pdserve_request_retries_total\{reason="decode_lost"\} [1-9]', metrics), metrics[-2000:]
        # Ray restarts the actor; its new process joins the router again
        assert eventually(lambda: len(healthy(url, "decode")) == 2, 60), healthy(url, "decode")
        assert {a["name"]: a for a in status()["actors"]}[victim["name"]]["restarts"] >= 1
        stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want

        # scale down while requests run: the drained worker finishes its streams first
        done = []

        def busy():
            try:
                done.append(len(client.completions.create(model="tiny-llama", prompt="drain " * 10, max_tokens=60,
                                                          extra_body={"ignore_eos": True}).choices[0].text))
            except openai.APIError as e:
                done.append(e)
        threads = [threading.Thread(target=busy) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1)
        cli("scale", "--name", NAME, "--decode", "1")
        for t in threads:
            t.join(120)
        assert len(done) == 4 and not [d for d in done if isinstance(d, Exception)], done
        assert eventually(lambda: len(healthy(url, "decode")) == 1, 30)
        assert [a["name"] for a in status()["actors"]] == ["decode-0", "prefill-0", "router"]
    finally:
        cli("down", "--name", NAME)
    ray.init(address=ray_cluster.address, namespace=f"pdserve-{NAME}", logging_level="ERROR",
             _node_ip_address="127.0.0.2", ignore_reinit_error=True)
    try:
        assert ray.util.list_named_actors() == []
    finally:
        ray.shutdown()
    assert eventually(lambda: not deployment_processes(), 20), deployment_processes()


def deployed_group(ray_cluster, name: str, prompt: str, *flags):
    """A deployment of one prefill and one decode worker with ``flags``; ``(url, answer, want)``: ``answer()`` asks
    it for ``prompt`` (greedy, 12 tokens) with the openai SDK, ``want`` is one engine's text."""
    reference = Engine(EngineConfig(threads=1))
    want = generate_many(reference, [prompt], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])[0][0]
    cli("ray", "--address", ray_cluster.address, "--name", name, "--prefill", "1", "--decode", "1", "--threads", "1",
        *flags, "--port", "0")
    url = status(name)["url"]
    assert eventually(lambda: len(healthy(url, "prefill")) == 1 and len(healthy(url, "decode")) == 1, 120)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def answer():
        return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    return url, answer, want


def restarted(url: str, decode: dict) -> bool:
    return eventually(lambda: [w["pid"] for w in healthy(url, "decode")] not in ([], [decode["pid"]]), 90)


def test_a_tensor_parallel_worker_is_one_actor_restarted_as_a_unit(ray_cluster):
    """``--tp 2``: each worker's ranks run under its actor; a follower rank SIGKILLed takes the worker and its actor
    down, Ray restarts the actor, and the group serves the reference tokens again."""
    name = NAME + "-tp"
    try:
        url, answer, want = deployed_group(ray_cluster, name, "Two ranks answer", "--tp", "2")
        assert answer() == want
        decode = healthy(url, "decode")[0]
        assert decode["tp"] == 2
        os.kill(decode["rank_pids"][0], signal.SIGKILL)
        assert restarted(url, decode)
        assert {a["name"]: a for a in status(name)["actors"]}["decode-0"]["restarts"] >= 1
        assert answer() == want
    finally:
        cli("down", "--name", name)


def test_a_pipeline_spread_over_two_nodes_serves_and_restarts_as_a_unit(ray_cluster):
    """``--pp 2 --pp-spread``: each worker's stage 1 runs under an actor on the other node (a STRICT_SPREAD
    placement group), its sockets on that node's address; the KV goes between the nodes by layer range; a stage
    SIGKILLed takes its worker down and Ray restarts the pipeline as a unit."""
    name = NAME + "-pp"
    try:
        url, answer, want = deployed_group(ray_cluster, name, "Two stages answer", "--pp", "2", "--pp-spread")
        assert answer() == want
        for role in ("prefill", "decode"):
            worker = healthy(url, role)[0]
            assert worker["pp"] == 2 and sorted(worker["stage_hosts"]) == ["127.0.0.2", "127.0.0.3"]
        decode = healthy(url, "decode")[0]
        os.kill(decode["stage_pids"][0], signal.SIGKILL)
        assert restarted(url, decode)
        assert sorted(healthy(url, "decode")[0]["stage_hosts"]) == ["127.0.0.2", "127.0.0.3"]
        assert answer() == want
    finally:
        cli("down", "--name", name)


def test_without_an_address_a_local_ray_cluster_is_started_and_down_stops_it(tmp_path):
    """The same command on one machine: ``deploy ray`` starts a Ray cluster of its own (token auth on), serves
    over the ray transport between actors, and ``down`` stops everything it started."""
    name = f"local-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)

    def run(*args):
        out = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "deploy", *args,
                              "--name", name], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    run("ray", "--prefill", "1", "--decode", "1", "--threads", "1", "--transport", "ray", "--port", "0")
    try:
        state = json.load(open(os.path.join(tmp_path, ".pdserve", "deployments", f"{name}.json")))
        assert oct(os.stat(os.path.join(tmp_path, ".pdserve", "deployments", f"{name}.json")).st_mode)[-3:] == "600"
        assert state["ray_env"]["RAY_AUTH_MODE"] == "token" and state["local_groups"]
        url = json.loads(run("status", "--json"))["url"]
        assert eventually(lambda: healthy(url, "prefill") and healthy(url, "decode"), 120)
        body = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "Over Ray", "max_tokens": 5, "ignore_eos": True}).json()
        assert body["usage"]["completion_tokens"] == 5 and body["pdserve"]["transport"] == "ray"
    finally:
        run("down")
    groups = state["local_groups"]
    assert eventually(lambda: not any(_group_alive(g) for g in groups), 30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_kv_pool_deployed_on_ray_gives_a_prefix_one_prefill_worker_computed_to_the_other(ray_cluster):
    """``--kv-pool mooncake``: the deployment's master and its node's daemon come up as actors, both prefill
    workers join the daemon, and the second takes the first's blocks from the pool."""
    pytest.importorskip("mooncake.store", exc_type=ImportError)
    name = NAME + "-pool"
    cli("ray", "--address", ray_cluster.address, "--name", name, "--prefill", "2", "--decode", "1", "--threads", "1",
        "--kv-pool", "mooncake", "--kv-pool-bytes", "256M", "--policy", "round_robin",
        "--prefill-resources", '{"node_b": 0.01}', "--decode-resources", '{"node_b": 0.01}', "--port", "0")
    try:
        url = status(name)["url"]
        assert eventually(lambda: len(healthy(url, "prefill")) == 2 and len(healthy(url, "decode")) == 1, 120)
        pool = [a for a in status(name)["actors"] if a["name"].startswith("kvpool-")]
        assert len(pool) == 2 and all(a["alive"] for a in pool), pool  # the master and node_b's daemon (every
        # worker is on node_b: a worker on node_a would have that node's daemon made too)
        assert {a["node_ip"] for a in pool if a["name"] != "kvpool-master"} == {"127.0.0.3"}
        prompt = [(i * 37) % 200 + 40 for i in range(300)]
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        cold = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert eventually(lambda: sum(w.get("pool_published", 0) for w in healthy(url, "prefill")) >= 18, 60)
        warm = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert warm["pdserve"]["cached_tokens_by_tier"].get("pool") == 288, warm["pdserve"]
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert pool_servers_on_node_b()
    finally:
        cli("down", "--name", name)
    assert eventually(lambda: not pool_servers_on_node_b(), 20), pool_servers_on_node_b()  # gone with their actors


def pool_servers_on_node_b() -> list[int]:
    return processes(lambda cmd: any(a.endswith(b"mooncake_client") for a in cmd) and b"--host=127.0.0.3" in cmd)
