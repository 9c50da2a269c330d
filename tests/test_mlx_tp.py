"""The MLX engine at TP=2 (mlx-lm's sharded models over an ``mx.distributed`` ring of two processes): greedy tokens
equal the torch engine's for Llama, Qwen3 and the built-in model, joining mid-run and in chunks; ``pdserve up`` with
mlx groups on either side, and an mlx prefill group handing whole heads to a torch decode group, stream the
reference; a TP mlx-lm cannot split is a clear error."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from deploy.local import Cluster  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generate import generate_many  # noqa: E402
from tests.streams import StreamClient, started  # noqa: E402
from tests.test_mlx_engine import mlx_engine  # noqa: E402
from tests.test_paged_engine import prompts, write_family  # noqa: E402
from tests.test_tp_serving import reference, streams_of_the_reference  # noqa: E402, F401


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_colocated_mlx_tp2_streams_the_torch_engines_tokens(family, tmp_path):
    """A process can form one MLX group only, so the group runs under ``pdserve up`` (as users run it)."""
    path = write_family(tmp_path / family, family)
    ps = [bytes(p).decode("latin-1") for p in prompts(4, seed=6)]
    engine = Engine(EngineConfig(model=path, threads=1))
    want = [s.output_ids for _, s in generate_many(
        engine, [engine.tokenizer.encode(p) for p in ps],
        [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) for _ in ps])]
    cluster = Cluster("--colocated", "--engine", "mlx", "--tp", "2", "--model", path, "--max-batched-tokens", "16")
    try:
        cluster.wait_ready()
        bodies = [{"model": path.rsplit("/", 1)[1], "prompt": p, "max_tokens": 8, "temperature": 0,
                   "ignore_eos": True} for p in ps]
        clients = started([StreamClient(cluster.url, b) for b in bodies])  # batched, joining, prompts in chunks
        for c in clients:
            c.join(120)
        assert [c.error for c in clients] == [None] * 4
        assert [c.ids for c in clients] == want
    finally:
        cluster.stop()


def test_an_mlx_tp_that_mlx_lm_cannot_split_names_the_fix():
    with pytest.raises(ValueError, match="--tp 4 on the mlx engine needs the 2 KV heads to split evenly"):
        mlx_engine("tiny-llama", tp=4)


@pytest.mark.parametrize("args", [
    ("--engine", "mlx", "--prefill-tp", "2", "--decode-tp", "2"),
    ("--prefill-engine", "mlx", "--prefill-tp", "2", "--decode-tp", "2"),
], ids=["mlx2-mlx2", "mlx2-torch2"])
def test_up_with_mlx_groups_streams_the_reference(reference, args):  # noqa: F811
    cluster = Cluster(*args)
    try:
        cluster.wait_ready()
        streams_of_the_reference(cluster.url, reference)
    finally:
        cluster.stop()
