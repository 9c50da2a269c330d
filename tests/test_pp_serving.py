"""Serving with pipelines on the CPU: ``pdserve up --colocated --pp N`` streams the one-device reference through the
openai SDK, four at once, with each hop's phases in the ``pdserve`` block and in Prometheus; a stage that dies
fails its pipeline's streams within 5 s, and ``up`` restarts the pipeline as a unit; disaggregated, each prefill
stage sends its own layers to the decode worker, whose stage 0 hands its stages theirs: any pair of pipeline depths
streams the reference."""
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
    # --retries 0: a stream whose pipeline lost a stage ends with an error (with retries it would go on once the
    # pipeline is back, were it back within --retry-wait: a race with the restart)
    cluster = Cluster("--colocated", "--pp", str(pp), "--pp-transport", transport, "--retries", "0").wait_ready()
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


@pytest.mark.parametrize("transport,prefill_pp,decode_pp", [("tcp", 2, 1), ("tcp", 1, 2), ("shm", 2, 2)],
                         ids=lambda v: str(v))  # (splits that differ: the FP8 test below, 2 -> 3)
def test_kv_moves_by_layer_range_between_pipelines_and_single_workers(reference, transport, prefill_pp,  # noqa: F811
                                                                        decode_pp):
    cluster = Cluster("--prefill-pp", str(prefill_pp), "--decode-pp", str(decode_pp), "--transport", transport)
    try:
        cluster.wait_ready()
        clients = streams_of_the_reference(cluster.url, reference)
        block = clients[0].pdserve
        assert block["kv_bytes"] == 2 * 4 * 2 * 16 * 4 * (len(PROMPTS[0]) + 1)  # every layer, once
        if decode_pp > 1:  # each decode stage took its own layers (half of them) from the prefill stages
            assert [r["bytes"] for r in block["kv_ranks"]] == [block["kv_bytes"] // 2] * 2
        assert block["streamed"] == (prefill_pp == 1 and decode_pp > 1)  # one process streams layer by layer
        roles = {h["role"] for h in block.get("pp_hops", [])}
        assert roles == {r for r, n in (("prefill", prefill_pp), ("decode", decode_pp)) if n > 1}
        workers = health(cluster.url)["workers"]
        assert [w.get("pp", 1) for w in workers["prefill"] + workers["decode"]] == [prefill_pp, decode_pp]
        assert eventually(lambda: all_back(cluster.url), 30, 0.5)
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport,prefill,decode", [("tcp", "pp", "tp"), ("shm", "tp", "pp")], ids=str)
def test_kv_moves_between_a_pipeline_and_a_tensor_parallel_group(reference, transport, prefill, decode):  # noqa: F811
    cluster = Cluster(f"--prefill-{prefill}", "2", f"--decode-{decode}", "2", "--transport", transport)
    try:
        cluster.wait_ready()
        block = streams_of_the_reference(cluster.url, reference)[0].pdserve
        assert block["kv_bytes"] == 2 * 4 * 2 * 16 * 4 * (len(PROMPTS[0]) + 1)  # every layer and head, once
        # two decode ranks (each one KV head of every layer) or two decode stages (each both heads of two layers)
        assert [r["bytes"] for r in block["kv_ranks"]] == [block["kv_bytes"] // 2] * 2
        assert eventually(lambda: all_back(cluster.url), 30, 0.5)
    finally:
        cluster.stop()


def test_up_places_the_stages_with_the_placement_plan(reference):  # noqa: F811
    cluster = Cluster("--colocated", "--pp-nodes", "small:2.5,big:8", "--max-model-len", "512",
                      "--max-num-seqs", "4").wait_ready()
    try:
        worker = health(cluster.url)["workers"]["colocated"][0]
        assert worker["pp"] == 2 and [end - first for first, end in worker["pp_layers"]] == [1, 3]  # small: fewer
        streams_of_the_reference(cluster.url, reference)
    finally:
        cluster.stop()


def test_a_mixed_worker_with_a_pipeline_is_a_clear_error():
    from decode.mixed import MixedWorker
    from engine import EngineConfig

    with pytest.raises(ValueError, match="--pp 1"):
        MixedWorker(EngineConfig(pp=2))


def test_an_fp8_kv_moves_between_pipelines_with_each_ranges_scales(tmp_path):
    """Prefill stages (0,1),(1,3) to decode stages (0,1),(1,2),(2,3): decode stage 2 takes layer 2 out of prefill
    stage 1's range, with that layer's scale (each layer has its own)."""
    from tests.streams import streams_the_engines_tokens
    from tests.test_pipeline import scaled_checkpoint

    clients = streams_the_engines_tokens(scaled_checkpoint(tmp_path), ["an fp8 pipeline", "layers and their scales"],
                                         ["--prefill-pp", "2", "--decode-pp", "3", "--kv-cache-dtype", "fp8"],
                                         kv_cache_dtype="fp8")
    assert len(clients[0].pdserve["kv_ranks"]) == 3
