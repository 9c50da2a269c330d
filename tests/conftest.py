import importlib.util
import json
import os
import resource
import secrets
import time

import pytest

from deploy.local import Cluster
from tests.durations import heaviest_first

# Ray reads its auth settings when first imported: fix the test session's token before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))

# CPU workers' KV pools at 512 MiB, not 2 GiB: a checkpoint with a 4k context (tests.checkpoints.SLOW) made every
# worker zero 2 GiB at start, a cluster of five 10 GiB between them
os.environ.setdefault("PDSERVE_CPU_KV_MIB", "512")


def pytest_collection_modifyitems(config, items):
    heaviest_first(items)  # the longest modules first, so that none is left alone at the end (tests/durations.py)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``PDSERVE_TEST_CPU=FILE``: each test's CPU seconds (this process and the children it reaped: its clusters)
    and wall seconds appended to FILE as JSON lines, to find where the suite's time goes."""
    path = os.environ.get("PDSERVE_TEST_CPU")
    if not path:
        yield
        return

    def cpu():
        return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                              resource.RUSAGE_CHILDREN)))
    c0, w0 = cpu(), time.monotonic()
    yield
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu() - c0, 2),
                            "wall_s": round(time.monotonic() - w0, 2)}) + "\n")


@pytest.fixture
def few_splits(monkeypatch):
    """Tiny engines on the Triton kernels under the interpreter, where a program costs ~40 ms: decode attention split
    for 2 stand-in SMs, not 8 (4 splits at batch 1, not 16). The kernels' own tests keep 8 (their many splits)."""
    from engine.kernels import triton_attention
    monkeypatch.setattr(triton_attention, "CPU_SMS", 2)


@pytest.fixture(scope="session")
def clusters():
    started = {"disagg": Cluster(), "colocated": Cluster("--colocated")}
    try:
        for c in started.values():
            c.wait_ready()
        yield started
    finally:
        for c in started.values():
            c.stop()


@pytest.fixture(scope="session")
def disagg(clusters):
    return clusters["disagg"]


@pytest.fixture(scope="session")
def colocated(clusters):
    return clusters["colocated"]


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster on loopback (127.0.0.2 head, 127.0.0.3 with resource node_b)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray not installed")
    from deploy.raycluster import RayCluster

    cluster = RayCluster(num_cpus=2, token=os.environ["RAY_AUTH_TOKEN"]).start()
    try:
        cluster.add_node("127.0.0.3", resources='{"node_b": 4}')
        saved = {k: os.environ.get(k) for k in cluster.env}
        os.environ.update(cluster.env)
        yield cluster
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
