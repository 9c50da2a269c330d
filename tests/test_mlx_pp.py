"""The MLX engine with pipeline stages (``--pp``: each rank of an ``mx.distributed`` ring holds a range of mlx-lm's
layers, hidden states sent rank to rank): greedy tokens equal the torch engine's for Qwen3 over three stages
(batched in three micro-batches in flight together, joining mid-run, prompts in chunks) and the built-in model; every hop's wire time and bytes reach the
response; mlx pipelines hand their KV (gathered through rank 0) to mlx and torch pipelines of another split."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from deploy.local import Cluster  # noqa: E402
from tests.test_mlx_tp import cluster_streams_the_torch_tokens  # noqa: E402
from tests.test_paged_engine import write_family  # noqa: E402
from tests.test_tp_serving import reference, streams_of_the_reference  # noqa: E402, F401


def test_colocated_mlx_pp3_streams_the_torch_engines_tokens(tmp_path):
    """A process can form one MLX group only, so the stages run under ``pdserve up`` (as users run them)."""
    path = write_family(tmp_path / "qwen3", "qwen3")  # three layers: one per stage
    clients = cluster_streams_the_torch_tokens(path, 7, "--pp", "3", max_tokens=24)
    worker = clients[0].health["workers"]["colocated"][0]
    assert (worker["pp"], worker["pp_layers"], len(worker["stage_pids"])) == (3, [[0, 1], [1, 2], [2, 3]], 2)
    assert worker["pp_in_flight_max"] == 3  # decode kept a micro-batch in every stage
    hops = clients[0].pdserve["pp_hops"]
    assert [h["hop"] for h in hops] == ["0->1", "1->2", "2->0"]
    assert all(h["steps"] >= 8 and h["wire"] > 0 and h["bytes"] > 0 for h in hops)


def test_a_long_prompts_chunks_follow_each_other_into_the_stages(tmp_path):
    from tests.streams import streams_the_engines_tokens

    path = write_family(tmp_path / "qwen3", "qwen3")
    prompt = "".join(chr(33 + i % 90) for i in range(110))  # 8 chunks of 16 tokens
    clients = streams_the_engines_tokens(path, [prompt], ["--colocated", "--engine", "mlx", "--pp", "3",
                                                          "--max-batched-tokens", "16"])
    assert clients[0].health["workers"]["colocated"][0]["pp_in_flight_max"] == 3  # one sequence: its chunks


@pytest.mark.parametrize("args", [
    ("--engine", "mlx", "--prefill-pp", "2", "--decode-pp", "3"),
    ("--prefill-engine", "mlx", "--prefill-pp", "2", "--decode-pp", "2"),
], ids=["mlx-pp2-mlx-pp3", "mlx-pp2-torch-pp2"])
def test_up_with_mlx_pipelines_streams_the_reference(reference, args):  # noqa: F811
    cluster = Cluster(*args)
    try:
        cluster.wait_ready()
        block = streams_of_the_reference(cluster.url, reference)[0].pdserve
        assert {h["role"] for h in block["pp_hops"]} == {"prefill", "decode"}
    finally:
        cluster.stop()
