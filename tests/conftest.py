import pytest

from tests.cluster import Cluster


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
