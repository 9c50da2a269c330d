"""The FP8 KV cache (``--kv-cache-dtype fp8``, ``engine.quant.kv_fp8``): its error against the model's own KV dtype,
half the bytes per token in the pool and on the wire, disaggregated equal to colocated, and KV converted on
arrival between workers that keep different KV dtypes."""
import httpx
import pytest
import torch

from deploy.local import Cluster
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate, generate_many
from engine.kernels import paged
from engine.quant import kv_fp8
from kvtransfer import KVLayout
from kvtransfer.convert import convert, layout_for, needs_convert

PREFIX = "Once upon a time there was a small model that wanted to serve tokens quickly and honestly. " * 2
PROMPTS = ["Hello", "The capital of France is", "x" * 300]


def test_quantize_saturates_and_keeps_e4m3_precision():
    x = torch.randn(100_000) * 3
    q = kv_fp8.quantize(x, 0.5)
    assert q.dtype == torch.float8_e4m3fn
    err = (kv_fp8.dequantize(q, 0.5, torch.float32) - x).norm() / x.norm()
    assert 0.015 < err < 0.035  # 3 mantissa bits: ~2.7% RMS at any scale in range
    big = kv_fp8.quantize(torch.tensor([1e6, -1e6]), 1.0).float()
    assert big.tolist() == [448.0, -448.0]  # saturated, not NaN (torch's own cast gives NaN)


def test_convert_between_dtypes_and_scales():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    src = layout_for((1, 2, 8), 5, torch.float8_e4m3fn, [(0.5, 2.0)])
    fp8 = [(kv_fp8.quantize(k, 0.5), kv_fp8.quantize(v, 2.0))]
    (k16, v16), = convert(fp8, src, torch.bfloat16)
    assert k16.dtype == torch.bfloat16
    torch.testing.assert_close(k16.float(), fp8[0][0].float() * 0.5, atol=0.02, rtol=0.01)
    torch.testing.assert_close(v16.float(), fp8[0][1].float() * 2.0, atol=0.02, rtol=0.01)
    (k8, v8), = convert(fp8, src, torch.float8_e4m3fn, [(0.5, 2.0)])  # same scales: the same bytes
    assert torch.equal(k8.view(torch.uint8), fp8[0][0].view(torch.uint8))
    (k8, _), = convert(fp8, src, torch.float8_e4m3fn, [(1.0, 1.0)])  # other scales: requantized
    torch.testing.assert_close(k8.float(), (fp8[0][0].float() * 0.5), atol=0.02, rtol=0.07)
    assert not needs_convert(src, torch.float8_e4m3fn, [(0.5, 2.0)])
    assert needs_convert(src, torch.float8_e4m3fn, None) and needs_convert(src, torch.bfloat16)
    assert not needs_convert(KVLayout(1, 2, 8, 5, "bfloat16"), torch.bfloat16)


def test_paged_decode_reads_fp8_as_its_dequantized_values():
    torch.manual_seed(0)
    blocks, bs, heads, kv_heads, dim = 6, 4, 4, 2, 8
    kc32, vc32 = torch.randn(blocks, bs, kv_heads, dim), torch.randn(blocks, bs, kv_heads, dim)
    scales = (0.25, 0.5)
    kc8, vc8 = kv_fp8.quantize(kc32, scales[0]), kv_fp8.quantize(vc32, scales[1])
    q = torch.randn(2, heads, dim)
    tables, lens = torch.tensor([[0, 2, 4], [1, 3, 5]]), torch.tensor([9, 12])
    got = paged.decode(q, kc8, vc8, tables, lens, 0.3, scales=scales)
    want = paged.decode(q, kc8.float() * scales[0], vc8.float() * scales[1], tables, lens, 0.3)
    torch.testing.assert_close(got, want)
    slots = torch.tensor([3, -1])
    paged.store_kv(kc8, vc8, torch.full((2, kv_heads, dim), 1.0), torch.full((2, kv_heads, dim), 1.0), slots, scales)
    assert kc8.view(-1, kv_heads, dim)[3].float().unique().tolist() == [4.0]  # 1.0 / 0.25
    assert vc8.view(-1, kv_heads, dim)[3].float().unique().tolist() == [2.0]


def _capture(kv_cache_dtype: str, dtype: str):
    """Each layer's attention output (o_proj's input) and the logits for a prompt whose first part is read back
    from the prefix cache (so its K/V come out of the pool)."""
    engine = Engine(EngineConfig(kv_cache_dtype=kv_cache_dtype, dtype=dtype, decode_graphs="off", threads=1))
    outs, logits = [], []
    for layer in engine.model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: outs.append(a[0].detach().float().clone()))
    generate_many(engine, [PREFIX], [SamplingParams(max_tokens=1, temperature=0.0)])
    outs.clear()
    head = engine.model.logits
    engine.model.logits = lambda h: logits.append(head(h).float()) or logits[-1]
    generate_many(engine, [PREFIX + "And then it decoded a few more words."], [SamplingParams(max_tokens=1)])
    assert engine.prefix_hits == 1
    return outs, logits[0]


def test_fp8_kv_error_against_the_models_own_kv():
    """Attention output within 5% per layer (the e4m3 floor: ~2.7% on V alone, the K error adds; see bench/RESULTS.md, FP8), logits
    cosine >= 0.99."""
    ref, ref_logits = _capture("auto", "bfloat16")
    got, got_logits = _capture("fp8", "bfloat16")
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
    assert len(errors) == 4 and max(errors) < 0.05, errors
    finite = torch.isfinite(ref_logits) & torch.isfinite(got_logits)
    cosine = torch.nn.functional.cosine_similarity(ref_logits[finite], got_logits[finite], dim=0)
    assert cosine >= 0.99


def test_fp8_pool_holds_twice_the_tokens_in_the_same_budget():
    bf16 = Engine(EngineConfig(dtype="bfloat16", kv_budget_bytes=1 << 20, threads=1, decode_graphs="off"))
    fp8 = Engine(EngineConfig(dtype="bfloat16", kv_cache_dtype="fp8", kv_budget_bytes=1 << 20, threads=1,
                              decode_graphs="off"))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.pool.layers[0][0].dtype == torch.float8_e4m3fn and fp8.kv_scales == [(1.0, 1.0)] * 4


def _complete(url, prompt, **body):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0, "return_token_ids": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def fp8_clusters():
    clusters = {name: Cluster(*args) for name, args in {
        "disagg": ("--kv-cache-dtype", "fp8"),
        "colocated": ("--kv-cache-dtype", "fp8", "--colocated"),
        "fp8_to_bf16": ("--dtype", "bfloat16", "--prefill-kv-cache-dtype", "fp8"),
        "bf16_to_fp8": ("--dtype", "bfloat16", "--decode-kv-cache-dtype", "fp8"),
    }.items()}
    try:
        yield {name: c.wait_ready() for name, c in clusters.items()}
    finally:
        for c in clusters.values():
            c.stop()


def test_disaggregated_fp8_equals_colocated_fp8_and_moves_half_the_bytes(fp8_clusters):
    runner = Engine(EngineConfig(threads=1, kv_cache_dtype="fp8"))
    for prompt in PROMPTS:
        want = generate(runner, prompt, SamplingParams(max_tokens=16, temperature=0))[1]
        got = [_complete(fp8_clusters[n].url, prompt) for n in ("disagg", "colocated")]
        assert [g["choices"][0]["token_ids"] for g in got] == [want, want]
        timing = got[0]["pdserve"]
        tokens = got[0]["usage"]["prompt_tokens"]
        assert timing["kv_bytes"] == 4 * 2 * 2 * tokens * 16 * 1  # fp32 model: a quarter of its fp32 KV
        assert timing["convert"] == 0
    health = httpx.get(fp8_clusters["disagg"].url + "/health").json()
    assert health["workers"]["decode"][0]["kv_dtype"] == "float8_e4m3fn"


@pytest.mark.parametrize("name, kv_bytes_per_element", [("fp8_to_bf16", 1), ("bf16_to_fp8", 2)])
def test_workers_of_different_kv_dtypes_convert_on_arrival(fp8_clusters, name, kv_bytes_per_element):
    """What moves is the prefill side's dtype; the decode side converts it in the ``convert`` phase."""
    for prompt in PROMPTS:
        body = _complete(fp8_clusters[name].url, prompt, max_tokens=12)
        timing = body["pdserve"]
        assert body["usage"]["completion_tokens"] == 12
        assert timing["kv_bytes"] == 4 * 2 * 2 * body["usage"]["prompt_tokens"] * 16 * kv_bytes_per_element
        assert timing["convert"] > 0


def _optional(name, module=None):
    import importlib.util

    return pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(module or name) is None,
                                                       reason=f"{module or name} not installed"))


@pytest.mark.parametrize("transport", ["shm", "pickle", _optional("arrow", "pyarrow"), _optional("nixl"),
                                       _optional("mlx"), _optional("ray")])
def test_every_cpu_transport_moves_fp8_kv_as_it_is(transport):
    runner = Engine(EngineConfig(threads=1, kv_cache_dtype="fp8"))
    cluster = Cluster("--transport", transport, "--kv-cache-dtype", "fp8").wait_ready()
    try:
        for prompt in PROMPTS[1:]:
            want = generate(runner, prompt, SamplingParams(max_tokens=12, temperature=0))[1]
            body = _complete(cluster.url, prompt, max_tokens=12)
            assert body["choices"][0]["token_ids"] == want
            timing = body["pdserve"]
            assert timing["transport"] == transport and timing["convert"] == 0
            assert timing["kv_bytes"] == 4 * 2 * 2 * body["usage"]["prompt_tokens"] * 16
    finally:
        cluster.stop()


@pytest.mark.skipif(not __import__("importlib").util.find_spec("mlx_lm"), reason="mlx-lm not installed")
def test_mlx_engine_takes_fp8_kv_converted_and_refuses_an_fp8_cache_of_its_own():
    from engine.mlx.engine import MlxEngine

    with pytest.raises(ValueError, match="quantized form"):
        MlxEngine(EngineConfig(threads=1, kv_cache_dtype="fp8"))
    cluster = Cluster("--prefill-engine", "torch", "--decode-engine", "mlx", "--prefill-kv-cache-dtype", "fp8").wait_ready()
    try:
        body = _complete(cluster.url, PROMPTS[1], max_tokens=8)
        assert body["usage"]["completion_tokens"] == 8 and body["pdserve"]["convert"] > 0
        assert body["pdserve"]["kv_bytes"] == 4 * 2 * 2 * body["usage"]["prompt_tokens"] * 16
    finally:
        cluster.stop()
