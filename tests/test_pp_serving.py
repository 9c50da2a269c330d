"""Serving with pipelines on the CPU: ``pdserve up --colocated --pp N`` streams the one-device reference through the
openai SDK, four at once, with each hop's phases in the ``pdserve`` block and in Prometheus; a stage that dies
fails its pipeline's streams within 5 s, and ``up`` restarts the pipeline as a unit; a pipelined worker asked to
exchange KV with another is a clear error."""
import os
import re
import signal
import time

import httpx
import openai
import pytest

from deploy.local import Cluster
from tests.streams import StreamClient, started
from tests.test_failures import LONG, eventually
from tests.test_retry import all_back, health
from tests.test_tp_serving import PROMPTS, TOKENS, reference, streams_of_the_reference  # noqa: F401 (a fixture)


@pytest.mark.parametrize("pp,transport", [(2, "tcp"), (3, "shm")])
def test_up_with_a_pipeline_serves_the_reference_and_restarts_as_a_unit(reference, pp, transport):  # noqa: F811
    cluster = Cluster("--colocated", "--pp", str(pp), "--pp-transport", transport).wait_ready()
    try:
        clients = streams_of_the_reference(cluster.url, reference)
        hops = clients[0].pdserve["pp_hops"]
        assert [h["hop"] for h in hops] == [f"{i}->{(i + 1) % pp}" for i in range(pp)]
        assert all(h["role"] == "colocated" and h["steps"] >= TOKENS and h["bytes"] > 0 and h["wire"] > 0
                   for h in hops)
        sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        done = sdk.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert done.choices[0].text == httpx.post(cluster.url + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["text"]
        metrics = httpx.get(cluster.url + "/metrics").text
        assert re.search(r'pdserve_pp_hop_seconds_count\{hop="1->[02]",phase="wire",role="colocated"\}', metrics)
        worker = health(cluster.url)["workers"]["colocated"][0]
        assert worker["pp"] == pp and len(worker["stage_pids"]) == pp - 1
        if transport != "tcp":
            return
        streams = started([StreamClient(cluster.url, LONG) for _ in range(4)])
        for c in streams:
            c.wait_tokens(3)
        os.kill(worker["stage_pids"][-1], signal.SIGKILL)
        killed_at = time.monotonic()
        for c in streams:
            c.join(120)
        assert all(c.error and c.ended_at - killed_at <= 5 for c in streams)
        assert f"pipeline stage {pp - 1}" in streams[0].error["message"]
        def restarted():
            workers = health(cluster.url)["workers"]["colocated"]
            return all_back(cluster.url) and workers[0]["pid"] != worker["pid"] and workers[0]

        again = eventually(restarted, 90, 0.5)  # `up` restarted the pipeline as a unit
        assert again["restarts"] >= 1 and again["pid"] != worker["pid"] and again["pp"] == pp
        streams_of_the_reference(cluster.url, reference)
    finally:
        cluster.stop()


def test_a_pipelined_worker_that_would_move_kv_is_a_clear_error():
    from decode.worker import DecodeWorker
    from engine import EngineConfig

    with pytest.raises(ValueError, match="--pp 2 runs colocated workers only"):
        DecodeWorker(EngineConfig(pp=2))
