"""The fused decode attention (``triton_rope_decode``: rotary, the K/V store, split-K attention and the merge by the
last split, one launch) against ``paged.rope_decode`` (``rope_store`` then ``decode`` in torch): the same output
within rounding; the same pool bytes as ``triton_attention``'s three launches store; the counters left at zero.
Under Triton's interpreter where there is no GPU."""
import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU

from engine.kernels import paged

pytestmark = needs_triton


def setup(heads, kv_heads, dim, block, lens, dtype, fp8=False, seed=0):
    from engine.models.rope import Rotary
    from engine.quant import kv_fp8

    g = torch.Generator().manual_seed(seed)
    blocks, width = 48, 16
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=g) for _ in range(2))
    scales = (0.05, 0.02) if fp8 else None
    if fp8:
        k_cache, v_cache = kv_fp8.quantize(k_cache, scales[0]), kv_fp8.quantize(v_cache, scales[1])
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm[(i * width) % blocks:][:width] for i in range(len(lens))]).to(torch.int32)
    slots = torch.tensor([int(t[(n - 1) // block]) * block + (n - 1) % block if n else -1
                          for t, n in zip(tables, lens)])
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    rotary = Rotary(dim, 512, 10000.0)
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    lens = torch.tensor(lens, dtype=torch.int32)
    cpu = (qkv, rotary.cos[positions], rotary.sin[positions], k_cache, v_cache, slots, tables, lens)
    return [x.to(DEVICE) for x in cpu], scales


def run_both(heads, kv_heads, dim, block, lens, dtype, window=0, fp8=False):
    from engine.kernels import triton_rope_decode as fused

    (qkv, cos, sin, kc, vc, slots, tables, lens_t), scales = setup(heads, kv_heads, dim, block, lens, dtype, fp8,
                                                                   seed=heads + dim + len(lens))
    from engine.kernels import triton_attention

    pools = [(kc.clone(), vc.clone()) for _ in range(3)]
    args = (qkv, cos, sin), (slots, heads, kv_heads, tables, lens_t, dim ** -0.5, window, scales)
    want = paged.rope_decode(*args[0], *pools[0], *args[1])
    q = triton_attention.rope_store(qkv, cos, sin, *pools[2], slots, heads, kv_heads, scales)  # three launches
    unfused = triton_attention.decode(q, *pools[2], tables, lens_t, dim ** -0.5, window, scales=scales)
    got = fused.rope_decode(*args[0], *pools[1], *args[1])
    counts = fused._counters[(str(qkv.device), len(lens) * kv_heads)]
    # an FP8 pool: against the three launches (the interpreter's e4m3 cast rounds unlike torch's, see test_triton_ops)
    return unfused if fp8 and DEVICE == "cpu" else want, got, (pools[1], pools[2]), counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(8, 2, 32, 16, [200, 1, 0]), (4, 4, 16, 8, [37, 9]), (32, 8, 128, 16, [130]),
                                  (8, 1, 64, 16, [64, 129, 3, 0])], ids=str)
def test_one_launch_gives_what_rope_store_then_decode_give(case, dtype):
    heads, kv_heads, dim, block, lens = case
    want, got, pools, counts = run_both(heads, kv_heads, dim, block, lens, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    for a, b in zip(*pools):  # the new keys and values stored as the three launches store them, bit for bit
        assert torch.equal(a, b)
    assert not counts.any()  # every (row, KV head) merged once and set back for the next layer
    assert not got[[i for i, n in enumerate(lens) if n == 0]].any()  # a padding row: zeros, as decode gives


def test_a_window_and_an_fp8_pool():
    want, got, pools, counts = run_both(8, 2, 32, 16, [200, 40, 1], torch.float32, window=50)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want, got, pools, counts = run_both(8, 2, 32, 16, [200, 40, 1], torch.bfloat16, fp8=True)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(*pools):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not counts.any()


def test_the_decode_path_takes_the_fused_kernel_only_when_enabled(monkeypatch):
    from engine.kernels import triton_attention, triton_rope_decode as fused

    calls = []
    monkeypatch.setattr(fused, "rope_decode", lambda *a, **k: calls.append(a) or "fused")
    (qkv, cos, sin, kc, vc, slots, tables, lens), _ = setup(8, 2, 32, 16, [20], torch.float32)
    args = (qkv, cos, sin, kc, vc, slots, 8, 2, tables, lens, 32 ** -0.5)
    monkeypatch.setattr(fused, "ENABLED", False)
    assert isinstance(triton_attention.rope_decode(*args), torch.Tensor) and not calls
    monkeypatch.setattr(fused, "ENABLED", True)
    assert triton_attention.rope_decode(*args) == "fused" and len(calls) == 1
    assert not fused.takes(torch.zeros(1, 8 * 24, device=DEVICE), torch.zeros(1, 16, 2, 24, device=DEVICE))  # 24


@pytest.mark.usefixtures("few_splits")
def test_tiny_engine_decodes_the_same_tokens_through_the_fused_kernel(monkeypatch):
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.kernels import triton_attention, triton_rope_decode as fused

    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = ["a longer prompt for the tiny model " * 2, "x"]
    plain = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="off", threads=1, warmup=False))
    want = [s.output_ids for _, s in generate_many(plain, prompts, [greedy] * 2)]
    calls = []
    real = fused.rope_decode
    monkeypatch.setattr(fused, "ENABLED", True)
    monkeypatch.setattr(fused, "rope_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="eager", threads=1, warmup=False))
    fast.runner.graphs.ops = triton_attention  # the decode steps' attention on the kernels, the rest in torch
    got = [s.output_ids for _, s in generate_many(fast, prompts, [greedy] * 2)]
    assert got == want and len(calls) >= 4 * fast.model.spec.num_layers


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel is built by running it")
def test_the_fused_kernel_builds_for_hopper(monkeypatch):
    """What the interpreter cannot check: the atomics, barrier, cache modifiers and PDL as ptxas takes them, with the
    constexprs an H100/H200 launch has (bf16 on tensor cores, PDL on; a bf16 and an FP8 pool)."""
    import json

    from triton.runtime import interpreter

    from tests.test_kernels_build import kernel_case
    from tests.triton_env import compile_for_hopper

    cases, real = {}, interpreter.InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ == "_rope_decode_kernel":
            case = kernel_case(self.fn, args, kwargs)
            case[3].update(UPCAST=False, PRECISION="tf32")  # what a GPU runs bf16 with (the interpreter upcasts)
            cases.setdefault(json.dumps(case, sort_keys=True, default=str), case)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    run_both(32, 8, 128, 16, [130, 1], torch.bfloat16)
    run_both(32, 8, 128, 16, [130, 1], torch.bfloat16, fp8=True)
    built = compile_for_hopper(list(cases.values()))
    assert len(built) == 2 and not [b["error"][-800:] for b in built if "error" in b]
    ptx = built[0]["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx and "griddepcontrol.wait" in ptx and "ld.global.cg" in ptx
