"""The MLX engine at TP=2 (mlx-lm's sharded models over an ``mx.distributed`` ring of two processes): greedy tokens
equal the torch engine's for Llama, Qwen3 and the built-in model, joining mid-run and in chunks; ``pdserve up`` with
mlx groups on either side, and an mlx prefill group handing whole heads to a torch decode group, stream the
reference; a TP mlx-lm cannot split is a clear error."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from deploy.local import Cluster  # noqa: E402
from tests.streams import streams_the_engines_tokens  # noqa: E402
from tests.test_mlx_engine import mlx_engine  # noqa: E402
from tests.test_paged_engine import prompts, write_family  # noqa: E402
from tests.test_tp_serving import reference, streams_of_the_reference  # noqa: E402, F401


def cluster_streams_the_torch_tokens(path: str, seed: int, *flags, max_tokens: int = 8) -> list:
    """``pdserve up --colocated --engine mlx`` with ``flags``: four prompts at once (batched, joining, in chunks of
    16 tokens) stream the torch engine's greedy tokens."""
    ps = [bytes(p).decode("latin-1") for p in prompts(4, seed=seed)]
    return streams_the_engines_tokens(path, ps, ["--colocated", "--engine", "mlx", *flags, "--max-batched-tokens",
                                                 "16"], max_tokens)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_colocated_mlx_tp2_streams_the_torch_engines_tokens(family, tmp_path):
    """A process can form one MLX group only, so the group runs under ``pdserve up`` (as users run it)."""
    cluster_streams_the_torch_tokens(write_family(tmp_path / family, family), 6, "--tp", "2")


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
