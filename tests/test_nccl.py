"""The nccl transport's checks (bench/nccl_check.py) as two ranks: on two GPUs when they exist, and
always over gloo between two CPU processes (the same protocol code: GRANT, eager sends, draining,
ordering of sends and receives, pool blocks to pool blocks; only the backend differs); and
``pdserve up`` over it."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from deploy.local import Cluster
from tests.test_failures import eventually


def cpu_reference(prompts: list[str], tokens: int) -> list[list[int]]:
    """Greedy tokens of the built-in model in one process on the CPU (what the workers run with ``--device cpu``)."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    engine = Engine(EngineConfig(device="cpu", threads=1))
    out = generate_many(engine, [engine.tokenizer.encode(p) for p in prompts],
                        [SamplingParams(max_tokens=tokens, temperature=0) for _ in prompts])
    return [seq.output_ids for _, seq in out]


def run_check(tmp_path, *args) -> dict:
    out = tmp_path / "nccl.json"
    subprocess.run([sys.executable, "-m", "bench.nccl_check", "--out", str(out), *args], check=True, timeout=600)
    return json.loads(out.read_text())


def assert_conformant(report, eager=True, direct=False):
    assert all(report["checks"].values()), report["checks"]
    assert report["size_limit_refused"]
    assert report["placed_staged_bytes"] == 0 and report["pieces_staged_bytes"] == 0
    assert {"pieces-into-blocks", "pieces-into-buffer", "whole-into-blocks"} <= set(report["checks"])
    assert any(name.endswith("/blocks") for name in report["checks"])  # a timed payload sent pool to pool
    if direct:  # KV in blocks moved as pieces, one operation per segment (fragmented tables: gathered)
        assert report["piece_sends"] > 0 and report["gathered_bytes"] > 0 and report["scattered_bytes"] > 0
    else:  # every KV in blocks gathered into one buffer on the sender, scattered into blocks on the receiver
        assert report["piece_sends"] == 0 and report["gathered_bytes"] > 0 and report["scattered_bytes"] > 0
    assert not report["aborted_sent"] and report["after-abort_sent"]
    # aborted as it landed: the send completes (the receiver lets it finish) and the pair survives
    assert report["aborted-mid_sent"] is True and report["after-abort-mid_sent"] is True
    assert report["cancelled-mid_sent"] is True and "cancelled before it began" in report["queued-cancelled_sent"]
    assert report["pairs_aborted_by_mid_abort"] == 0
    hangup = report["hangup"]
    assert hangup["reported_error"] and hangup["seconds"] < 5 and hangup["world"], hangup
    if eager:
        assert report["drained"] == 1 and report["eager_sends"] > 0
    else:
        assert report["drained"] == 0 and report["eager_sends"] == 0


def test_nccl_protocol_over_gloo(tmp_path):
    assert_conformant(run_check(tmp_path, "--backend", "gloo"))


def test_nccl_protocol_over_gloo_granting_every_transfer(tmp_path):
    assert_conformant(run_check(tmp_path, "--backend", "gloo", "--no-eager", "--direct-cuts", "1"), eager=False,
                      direct=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl transport needs two CUDA GPUs")
def test_nccl_conformance_on_two_gpus(tmp_path):
    assert_conformant(run_check(tmp_path))


@pytest.mark.parametrize("stream", [False, True])
def test_up_over_nccl_moves_kv_from_pool_blocks_into_pool_blocks(stream):
    """``pdserve up --transport nccl`` (over gloo here): prefill sends from its pool's blocks, decode receives into
    its pool's blocks, and greedy output equals the one-device engine's on the same CPU, with requests in flight
    together; with ``nccl_stream=true`` layer by layer during the prefill forward."""
    extra = ["--kv-option", "nccl_stream=true"] if stream else []
    cluster = Cluster("--transport", "nccl", "--device", "cpu", "--kv-option", "nccl_backend=gloo", *extra).wait_ready()
    try:
        prompts = ["x", "hello world", "a much longer prompt " * 30, "tokens " * 17]
        bodies = [{"model": "tiny-llama", "prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
                  for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda b: httpx.post(cluster.url + "/v1/completions", json=b, timeout=120).json(),
                                    bodies))
        streamed = [disagg["pdserve"]["streamed"] for disagg in answers]
        # one at a time (nccl): a prompt streams only while no other push is in flight
        assert any(streamed) if stream else not any(streamed)
        for disagg, want in zip(answers, cpu_reference(prompts, 12)):  # not a colocated cluster: on a GPU machine
            assert disagg["choices"][0]["token_ids"] == want            # that one would run on the GPU
            assert disagg["pdserve"]["transport"] == "nccl" and disagg["pdserve"]["kv_bytes"] > 0

        def workers():  # /health shows what the workers last reported
            reported = httpx.get(cluster.url + "/health").json()["workers"]
            return reported["prefill"][0], reported["decode"][0]

        n = len(prompts) + httpx.get(cluster.url + "/health").json()["pairs"]["warm"]  # and the pair's warm-up

        def settled():
            prefill, decode = workers()
            return prefill["kv_from_blocks"] and decode["kv_landed_in_blocks"] == n
        eventually(settled, 10)
        prefill, decode = workers()
        assert prefill["kv_from_blocks"] == n and prefill["kv_staged_bytes"] == 0
        assert decode["kv_landed_in_blocks"] == n
        assert prefill["kv_pairs_aborted"] == 0 and decode["kv_pairs_aborted"] == 0  # nothing went wrong
        assert 'pdserve_worker_kv_pairs_aborted{role="prefill"' in httpx.get(cluster.url + "/metrics").text
    finally:
        cluster.stop()


def test_up_over_nccl_warms_every_pair_before_it_says_ready():
    """Each prefill -> decode pair forms its NCCL group (gloo here) with a warm-up request before /health is 200;
    the warm-ups count in no router metric; ``--warm-pairs never`` leaves the pairs to the first requests."""
    cluster = Cluster("--prefill", "2", "--transport", "nccl", "--device", "cpu", "--kv-option", "nccl_backend=gloo")
    cold = Cluster("--transport", "nccl", "--device", "cpu", "--kv-option", "nccl_backend=gloo", "--warm-pairs", "never")
    try:
        health = httpx.get(cluster.wait_ready().url + "/health").json()
        assert health["status"] == "ok" and health["pairs"] == {"warm": 2, "failed": 0, "pending": 0, "ready": True}
        assert eventually(lambda: httpx.get(cluster.url + "/health").json()["workers"]["decode"][0]
                          ["kv_landed_in_blocks"] == 2, 5)
        metrics = httpx.get(cluster.url + "/metrics").text
        assert "pdserve_kv_transfer_bytes_total{" not in metrics and "pdserve_requests_total{" not in metrics
        body = {"model": "tiny-llama", "prompt": "after the warm-up", "max_tokens": 6, "temperature": 0}
        answer = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 6 and answer["pdserve"]["kv_bytes"] > 0
        health = httpx.get(cold.wait_ready().url + "/health").json()
        assert health["status"] == "ok" and health["pairs"]["warm"] == 0
        assert httpx.get(cold.url + "/health").json()["workers"]["decode"][0]["kv_landed_in_blocks"] == 0
    finally:
        cluster.stop()
        cold.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the same-GPU path needs a CUDA GPU")
def test_nccl_between_two_processes_on_one_gpu_copies_through_cuda_ipc(tmp_path):
    """NCCL refuses two ranks on one GPU; the transport's pairs there (heterogeneous TP groups sharing a GPU) copy
    through a CUDA IPC mapping: every check bit-exact, pool blocks into pool blocks, no pair and no eager send."""
    report = run_check(tmp_path, "--same-gpu")
    assert all(report["checks"].values()), report["checks"]
    assert report["ipc_sends"] > 0 and report["ipc_receives"] == report["ipc_sends"]
    assert report["eager_sends"] == 0 and report["drained"] == 0 and report["piece_sends"] == 0
    assert report["placed_staged_bytes"] == 0 and report["gathered_bytes"] > 0 and report["scattered_bytes"] > 0
    assert report["size_limit_refused"] and not report["aborted_sent"] and report["after-abort_sent"]
    assert report["hangup"]["reported_error"] and report["hangup"]["seconds"] < 5
