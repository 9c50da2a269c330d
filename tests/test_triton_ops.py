"""The Triton kernels of the CUDA decode path against the torch operations they replace (``engine.paged``), bit for
bit on the stores and within rounding on attention: on a GPU, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set here when there is no GPU; the test extras install triton, so CI runs them).
Skipped where triton is not installed; ``bench/gpu/decode.sh test`` runs them on a GPU."""

import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU
from engine.kernels import paged

pytestmark = needs_triton
CASES = [(3, 8, 2, 16, 16, 0), (2, 4, 4, 12, 8, 0), (3, 8, 2, 16, 4, 5), (2, 32, 8, 128, 16, 0), (1, 32, 8, 128, 16, 40),
         (1, 4, 1, 32, 16, 0)]


def same_codes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """e4m3 tensors equal byte for byte; under the interpreter, whose fp32 -> e4m3 cast rounds a value just under a
    power of two down a whole binade and rounds ties away from zero, every difference must be one of those (want a
    power of two and got half of it, or the two a step of e4m3 apart)."""
    got, want = got.float().flatten(), want.float().flatten()
    if torch.cuda.is_available():
        return torch.equal(got, want)
    differ = got != want
    g, w = got[differ], want[differ]
    binade = (torch.log2(w.abs()).frac() == 0) & (g.abs() * 2 == w.abs())
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()))) - 3)
    return bool((binade | ((g - w).abs() <= step)).all() and differ.float().mean() < 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_torch_operations(case, dtype):
    from engine.kernels import triton_attention as triton_ops

    batch, heads, kv_heads, dim, block, window = case
    g = torch.Generator().manual_seed(sum(case))
    blocks = 24
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    lens = torch.tensor([37, 1, 0][:batch] if batch != 2 else [5, 90 // block * block - 3], dtype=torch.int32, device=DEVICE)
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm[:12] if b % 2 == 0 else perm[12:] for b in range(batch)]).to(DEVICE, torch.int32)
    q = torch.randn(batch, heads, dim, generator=g).to(DEVICE, dtype)
    want = paged.decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, window)
    got = triton_ops.decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    k, v = (torch.randn(4, kv_heads, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    slots = torch.tensor([5, -1, 17, blocks * block - 1], dtype=torch.long, device=DEVICE)
    ref, out = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    paged.store_kv(*ref, k, v, slots)
    triton_ops.store_kv(*out, k, v, slots)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    assert torch.equal(out[0].view(-1, kv_heads, dim)[17], k[2]) and torch.equal(out[1].view(-1, kv_heads, dim)[5], v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (2, 4096)])
def test_rmsnorm_kernel_matches_the_module(shape, dtype):
    from engine.kernels import triton_layers
    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        want = norm(x)
    got = triton_layers.rmsnorm(x, norm.weight, 1e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2 * 40), (5, 2 * 2048), (1, 2 * 14336)])
def test_silu_mul_kernel_matches_the_module(shape, dtype):
    from engine.kernels import triton_layers

    g = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = triton_layers.silu_mul(x)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(4, 2, 16), (32, 8, 128), (4, 4, 12)])
def test_rotary_kernel_matches_the_module(dims, dtype):
    from engine.kernels import triton_layers
    from engine.models.rope import Rotary

    heads, kv_heads, dim = dims
    rotary = Rotary(dim, 256, 10000.0).to(DEVICE)
    g = torch.Generator().manual_seed(dim)
    positions = torch.tensor([0, 7, 100, 255, 3], device=DEVICE)
    q = torch.randn(5, heads, dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(5, kv_heads, dim, generator=g).to(DEVICE, dtype)
    want = rotary(positions, q, k)
    got = triton_layers.rotary(q, k, rotary.cos[positions], rotary.sin[positions])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5 if dtype == torch.float32 else 3.2e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 2e-2)  # bf16: one unit in the last place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_rounds_like_the_torch_form(dtype):
    from engine.kernels import triton_layers
    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(5, 96, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(DEVICE)
    norm.weight.data = torch.rand(96, generator=g).to(DEVICE) + 0.5
    want = norm(x, r)
    got = triton_layers.add_rmsnorm(x, r, norm.weight, 1e-5)
    for a, b in zip(got, want):  # the interpreter truncates to bf16 where a GPU rounds: one unit in the last place
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5 if dtype == torch.float32 else 3.2e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("hb", [1, 4])  # a program per head (decode), per block of heads (prompts)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 8, 128), (4, 1, 32), (6, 2, 16)], ids=str)
def test_rope_store_matches_the_torch_form(shape, dtype, hb):
    from engine.kernels import triton_attention
    from engine.models.rope import Rotary

    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(heads + dim)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    rotary = Rotary(dim, 256, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 7, 99, 255], device=DEVICE)
    slots = torch.tensor([3, -1, 40, 9], device=DEVICE)
    pools = [[torch.zeros(6, 8, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2)] for _ in range(2)]
    args = (rotary.cos[positions], rotary.sin[positions])
    want = paged.rope_store(qkv, *args, *pools[0], slots, heads, kv_heads)
    got = triton_attention.rope_store(qkv, *args, *pools[1], slots, heads, kv_heads, heads_a_program=hb)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3.2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    for a, b in zip(pools[1], pools[0]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert pools[1][1].view(-1, kv_heads, dim)[40].equal(qkv[2, (heads + kv_heads) * dim:].view(kv_heads, dim))
    # keep: the same queries and pool, and the new keys and values as computed (a padding row's too)
    kept = [[torch.zeros_like(p) for p in pool] for pool in pools]
    want = paged.rope_store(qkv, *args, *kept[0], slots, heads, kv_heads, keep=True)
    got = triton_attention.rope_store(qkv, *args, *kept[1], slots, heads, kv_heads, keep=True, heads_a_program=hb)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    for a, b in zip(kept[1] + kept[0], pools[1] + pools[0]):
        assert a.equal(b)
    assert got[2].equal(qkv[:, (heads + kv_heads) * dim:].view(4, kv_heads, dim))


@pytest.mark.usefixtures("few_splits")
def test_tiny_engine_on_the_kernels_gives_the_same_tokens():
    from engine import EngineConfig, SamplingParams
    from engine.kernels import triton_attention as triton_ops, triton_layers
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.models.llama import use_kernels

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["hello", "a longer prompt for the tiny model " * 2, "x"]
    plain = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="off", threads=1))
    want = [s.output_ids for _, s in generate_many(plain, prompts, [greedy] * 3)]
    fast = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="eager", threads=1, max_num_seqs=12))
    fast.runner.graphs.ops = triton_ops
    use_kernels(fast.model, triton_layers)
    fast.warm_up()  # compiles the decode variants mixed steps pick, then runs the warm-up workload
    got = [s.output_ids for _, s in generate_many(fast, prompts, [greedy] * 3)]
    assert got == want and fast.runner.graphs.runs >= 5  # every decode step through the graph's kernels
    from engine.sequence import Sequence  # one joins mid-run: mixed steps (decode rows through the kernels)

    seqs = [Sequence.create(f"m{i}", p, greedy, fast.tokenizer, fast.max_len) for i, p in enumerate(prompts)]
    fast.add(seqs[0])
    for step in range(40):
        if step in (3, 5):
            fast.add(seqs[1 if step == 3 else 2])
        fast.step()
        if step > 5 and all(s.finished for s in seqs):
            break
    assert [s.output_ids for s in seqs] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen runs on CUDA")
@pytest.mark.parametrize("window", [0, 7])
def test_varlen_prefill_matches_one_sdpa_per_prompt(window):
    from engine.attention import varlen_kernel

    run = varlen_kernel()
    if run is None:
        pytest.skip("this torch has no varlen_attn")
    lens, heads, kv_heads, dim = [5, 33, 1, 64], 32, 8, 128
    g = torch.Generator().manual_seed(window)
    q = torch.randn(sum(lens), heads, dim, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(sum(lens), kv_heads, dim, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    starts = torch.tensor([0, 5, 38, 39, 103], dtype=torch.int32, device=DEVICE)
    if window and not run.windows:
        pytest.skip("this torch's varlen_attn has no window")
    got = run(q, k, v, starts, max(lens), dim ** -0.5, window)
    for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
        n = e - s
        pos = torch.arange(n, device=DEVICE)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        want = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None].float(), k[s:e].transpose(0, 1).repeat_interleave(4, 0)[None].float(),
            v[s:e].transpose(0, 1).repeat_interleave(4, 0)[None].float(), attn_mask=mask, scale=dim ** -0.5)
        torch.testing.assert_close(got[s:e].float(), want[0].transpose(0, 1), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen runs on CUDA")
@pytest.mark.parametrize("window", [0, 7])
def test_varlen_over_cached_prefixes_matches_one_sdpa_per_chunk(window):
    """Prompt chunks after prefixes already in the pool (prefix-cache hits, later chunks of long prompts): one
    varlen call over keys gathered from the pool gives what one SDPA call per chunk gives."""
    from engine.attention import attend, build_meta, token_slot, varlen_kernel

    if varlen_kernel() is None:
        pytest.skip("this torch has no varlen_attn")
    new, ctx, heads, kv_heads, dim, block = [5, 33, 1, 64], [21, 33, 40, 80], 32, 8, 128, 16
    g = torch.Generator().manual_seed(5 + window)
    k_cache, v_cache = (torch.randn(40, block, kv_heads, dim, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    order = torch.randperm(40, generator=g)
    tables = [order[i * 8:(i + 1) * 8].tolist() for i in range(4)]
    slots = torch.tensor([token_slot(t, p, block) for t, c, n in zip(tables, ctx, new) for p in range(c - n, c)],
                         device=DEVICE)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = torch.randn(sum(new), heads, dim, generator=g).to(DEVICE, torch.bfloat16)
    k, v = k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots]
    t = torch.tensor(tables, device=DEVICE)
    lens = torch.tensor(ctx, device=DEVICE)
    fast = build_meta(slots, starts, ctx, t, lens, block, window, None, None, varlen=True)
    slow = build_meta(slots, starts, ctx, t, lens, block, window, None, None, varlen=False)
    assert fast.varlen_cached is not None and slow.varlen_cached is None
    got = attend(q, k, v, k_cache, v_cache, fast, dim ** -0.5)
    want = attend(q, k, v, k_cache, v_cache, slow, dim ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pool_kernels_match_the_torch_forms(dtype):
    """An FP8 pool (``quant.kv_fp8``): stores quantize as the torch forms do, byte for byte; decode reads the same
    dequantized values (the scales folded in)."""
    from engine.kernels import triton_attention as triton_ops
    from engine.models.rope import Rotary
    from engine.quant import kv_fp8

    heads, kv_heads, dim, block, blocks = 8, 2, 32, 16, 12
    g = torch.Generator().manual_seed(8)
    scales = (0.05, 0.02)
    k_cache = kv_fp8.quantize(torch.randn(blocks, block, kv_heads, dim, generator=g), scales[0]).to(DEVICE)
    v_cache = kv_fp8.quantize(torch.randn(blocks, block, kv_heads, dim, generator=g), scales[1]).to(DEVICE)
    q = torch.randn(3, heads, dim, generator=g).to(DEVICE, dtype)
    tables = torch.randperm(blocks, generator=g)[:12].view(3, 4).to(DEVICE, torch.int32)
    lens = torch.tensor([40, 1, 64], dtype=torch.int32, device=DEVICE)
    want = paged.decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, scales=scales)
    got = triton_ops.decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, scales=scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype) * 30  # some saturate
    rotary = Rotary(dim, 256, 10000.0).to(DEVICE)
    positions, slots = torch.tensor([0, 7, 99, 255], device=DEVICE), torch.tensor([3, -1, 40, 9], device=DEVICE)
    pools = [[c.clone() for c in (k_cache, v_cache)] for _ in range(2)]
    args = (qkv, rotary.cos[positions], rotary.sin[positions])
    paged.rope_store(*args, *pools[0], slots, heads, kv_heads, scales)
    triton_ops.rope_store(*args, *pools[1], slots, heads, kv_heads, scales)
    assert pools[1][0].float().abs().max() == 448.0 and not pools[1][1].float().isnan().any()
    k, v = (torch.randn(4, kv_heads, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    for ops, pool in ((paged, pools[0]), (triton_ops, pools[1])):
        ops.store_kv(*pool, k, v, slots.flip(0), scales)
    for a, b in zip(pools[1], pools[0]):
        assert same_codes(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_matches_the_torch_form(dtype):
    from engine.kernels import triton_quant
    from engine.quant.fp8_linear import quantize_rows

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 200, generator=g) * torch.logspace(-2, 2, 5)[:, None]).to(DEVICE, dtype)
    x[4] = 0  # an all-zero row: the floor scale, zeros out
    (want, want_scale), (got, got_scale) = quantize_rows(x), triton_quant.quantize_rows(x)
    torch.testing.assert_close(got_scale, want_scale)
    assert same_codes(got, want)
    assert got[4].float().abs().max() == 0


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_fp8_weight_kernel_matches_scaled_mm_numbers(rows):
    """W8A8: the rows quantized per row (here, or given), the products, both scales (``_scaled_mm``'s numbers)."""
    from engine.kernels import triton_fp8
    from engine.quant.fp8_linear import quantize_rows

    g = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    weight, scale = quantize_rows(torch.randn(96, 200, generator=g))  # K not a multiple of the tile: masked
    x = torch.randn(rows, 200, generator=g).to(DEVICE, dtype)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE).reshape(1, -1)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ (weight.float() * scale.reshape(-1, 1)).t()
    config = triton_fp8.W8Config(block_n=32, block_k=64)
    given = triton_fp8.w8_matmul(xq, weight, scale, config, x_scale=xs, out_dtype=dtype)
    torch.testing.assert_close(given.float(), want.to(dtype).float(), atol=2e-2 * want.abs().max().item(), rtol=1e-2)
    from engine.kernels import triton_quant

    here = triton_fp8.w8_matmul(x, weight, scale, config)  # quantized by the kernel launch before it
    assert here.dtype == dtype and torch.equal(here, triton_fp8.w8_matmul(
        *triton_quant.quantize_rows(x)[:1], weight, scale, config, x_scale=triton_quant.quantize_rows(x)[1],
        out_dtype=dtype))


@pytest.mark.parametrize("residual", [False, True])
def test_fused_norm_quantizes_as_the_separate_launch(residual):
    """``rmsnorm_fp8`` writes what ``quantize_rows`` makes of ``add_rmsnorm`` (or ``rmsnorm``)."""
    from engine.kernels import triton_layers
    from engine.quant.fp8_linear import quantize_rows

    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    x, r = (torch.randn(3, 256, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(256, generator=g).to(DEVICE, dtype)
    if residual:
        (got, total) = triton_layers.rmsnorm_fp8(x, w, 1e-5, r)
        normed, want_total = triton_layers.add_rmsnorm(x, r, w, 1e-5)
        assert torch.equal(total, want_total)
    else:
        got, normed = triton_layers.rmsnorm_fp8(x, w, 1e-5), triton_layers.rmsnorm(x, w, 1e-5)
    wq, ws = quantize_rows(normed)
    torch.testing.assert_close(got.scales, ws)
    assert same_codes(got.values, wq)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 GEMMs and the e4m3 cast as the GPU does them")
def test_tiny_engine_with_fp8_weights_and_kv_on_the_gpu():
    """Decode graphs over the FP8 kernels (few-row FP8 GEMMs, FP8 pool) next to the bf16 engine."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    prompts = ["hello", "a longer prompt for the tiny model " * 3, "x"]
    last = {}
    for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=8, **kw))
        engine.warm_up()
        out = generate_many(engine, prompts, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 3)
        assert all(len(s.output_ids) == 12 for _, s in out) and engine.runner.graphs.replays > 0
        logits = []
        head = engine.model.logits
        engine.model.logits = lambda h: logits.append(head(h).float()) or logits[-1]
        engine.runner.graphs.prompts = engine.runner.graphs.mixed = None  # eager: the patched head sees the prompt
        generate_many(engine, [prompts[1]], [SamplingParams(max_tokens=1, temperature=0)])
        last[name] = logits[0][-1]
    finite = torch.isfinite(last["bf16"]) & torch.isfinite(last["fp8"])
    assert torch.nn.functional.cosine_similarity(last["bf16"][finite], last["fp8"][finite], dim=0) > 0.95


@pytest.mark.parametrize("tokens, experts, top_k", [(5, 4, 2), (40, 6, 2), (3, 16, 4), (2, 16, 4)])
def test_fused_moe_matches_the_expert_loop(tokens, experts, top_k):
    """Pairs sorted by expert, padded into blocks, two grouped GEMMs, the routing weight, each token's sum."""
    from engine.kernels import triton_moe
    from engine.models.moe import experts_reference

    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 48, 32
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w_down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(DEVICE)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), -1).to(DEVICE)
    weights, ids = probs.topk(top_k, dim=-1)
    slots, block_expert = triton_moe.align(ids, experts, 16)
    assert sorted(slots[slots < tokens * top_k].tolist()) == list(range(tokens * top_k))
    want = experts_reference(x, weights, ids, w_gate_up, w_down)
    got = triton_moe.experts(x, weights, ids, w_gate_up, w_down)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode graphs capture the MoE kernels on CUDA")
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_moe_engine_on_the_kernels_gives_the_same_tokens(tmp_path, family):
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many
    from tests.test_paged_engine import write_family

    path = write_family(tmp_path, family)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["hello", "a longer prompt for the tiny model " * 2, "x"]
    plain = Engine(EngineConfig(model=path, device="cuda", dtype="float32", decode_graphs="off", threads=1))
    want = [s.output_ids for _, s in generate_many(plain, prompts, [greedy] * 3)]
    fast = Engine(EngineConfig(model=path, device="cuda", dtype="float32", threads=1, max_num_seqs=8))
    fast.warm_up()
    assert [s.output_ids for _, s in generate_many(fast, prompts, [greedy] * 3)] == want
    assert fast.runner.graphs.replays > 0
