"""``pdserve up`` with the MLX engine: colocated, and heterogeneous pairs (prefill on MLX, decode on torch and the
other way round) over tcp and the mlx transport (ring), each equal to the torch engine's in-process reference."""
import importlib.util

import httpx
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from deploy.local import Cluster  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generate import generate_many  # noqa: E402

PROMPTS = ["The quick brown fox", "hi", "tokens " * 40]


@pytest.fixture(scope="module")
def reference():
    engine = Engine(EngineConfig(threads=1))
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(PROMPTS)
    return [s.output_ids for _, s in generate_many(engine, PROMPTS, params)]


@pytest.mark.parametrize("args", [
    ["--colocated", "--engine", "mlx"],
    ["--prefill-engine", "mlx", "--decode-engine", "torch", "--transport", "tcp"],
    ["--prefill-engine", "torch", "--decode-engine", "mlx", "--transport", "tcp"],
    ["--prefill-engine", "mlx", "--decode-engine", "torch", "--transport", "mlx"],
    ["--prefill-engine", "torch", "--decode-engine", "mlx", "--transport", "mlx"],
], ids=["colocated-mlx", "mlx-to-torch-tcp", "torch-to-mlx-tcp", "mlx-to-torch-ring", "torch-to-mlx-ring"])
def test_mlx_engine_serves_and_equals_the_reference(reference, args):
    cluster = Cluster(*args).wait_ready()
    try:
        got = [httpx.post(cluster.url + "/v1/completions", timeout=120, json={
            "model": "tiny-llama", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json() for p in PROMPTS]
        engines = {w.get("engine") for ws in httpx.get(cluster.url + "/health").json()["workers"].values() for w in ws}
    finally:
        cluster.stop()
    assert [g["choices"][0]["token_ids"] for g in got] == reference
    assert "mlx" in engines


def test_a_bf16_torch_prefill_and_an_fp32_mlx_decode_report_the_conversion():
    """Prefill on torch in bf16, decode on MLX in fp32: the KV is converted at the receiver (``convert``); the MLX
    prefill's copy out of its caches counts as ``d2h``."""
    from tests.fleet import Fleet

    for prefill, decode, phase in ((("--engine", "torch", "--dtype", "bfloat16"), ("--engine", "mlx"), "convert"),
                                   (("--engine", "mlx"), ("--engine", "torch"), "d2h")):
        fleet = Fleet().pair(prefill=prefill, decode=decode)
        try:
            body = httpx.post(fleet.url + "/v1/completions", timeout=120, json={
                "model": "tiny-llama", "prompt": "tokens " * 30, "max_tokens": 6, "ignore_eos": True}).json()
        finally:
            fleet.stop()
        assert body["usage"]["completion_tokens"] == 6
        assert body["pdserve"][phase] > 0, body["pdserve"]
