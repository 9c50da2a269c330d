"""The few-row GEMM kernel (``engine.kernels.triton_fewrow``: decode at batch 1-64, split along K) against
``nn.Linear`` / the W8A8 numbers, on a GPU or under Triton's interpreter (set when there is no GPU; CI runs them
so)."""
import os

import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton


def _fewrow():
    from engine.kernels import triton_fewrow

    return triton_fewrow


def _linear(out_f: int, in_f: int, g, bias: bool = False, dtype=torch.bfloat16) -> torch.nn.Linear:
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * in_f ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    return lin.to(DEVICE, dtype).requires_grad_(False)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("rows,split_k,bias", [(1, 1, False), (3, 2, True), (16, 3, False), (20, 4, False)])
def test_rows_match_the_linear_layer(rows, split_k, bias):
    """Any split (one that does not divide K's chunks too: 3 splits of 5) gives ``nn.Linear``'s output."""
    fr = _fewrow()
    g = torch.Generator().manual_seed(rows)
    lin = _linear(96, 320, g, bias)  # 320 = 5 chunks of 64; 96 outputs: a partial block of 64
    x = torch.randn(rows, 320, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.empty(rows, 96, dtype=torch.bfloat16, device=DEVICE)
    fr.matmul(x, lin.weight, fr.FewRowConfig(64, 64, 4, 2, split_k), out, bias=lin.bias)
    _close(out, lin(x))


def test_split_sums_do_not_depend_on_which_split_ends_last_and_counters_reset():
    """The partials are added in split order by whichever program ends last: launches repeat bit for bit, and
    each leaves the block counters at zero for the next."""
    fr = _fewrow()
    g = torch.Generator().manual_seed(1)
    lin = _linear(128, 512, g)
    x = torch.randn(5, 512, generator=g).to(DEVICE, torch.bfloat16)
    config = fr.FewRowConfig(32, 64, 4, 2, 4)
    outs = []
    for _ in range(3):
        outs.append(torch.empty(5, 128, dtype=torch.bfloat16, device=DEVICE))
        fr.matmul(x, lin.weight, config, outs[-1])
        assert not fr.counters(x.device).any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    one = torch.empty_like(outs[0])
    fr.matmul(x, lin.weight, fr.FewRowConfig(32, 64, 4, 2, 1), one)
    _close(outs[0], one)


@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_weights_give_the_w8a8_numbers(split_k):
    from engine.kernels import triton_fp8
    from engine.quant.fp8_linear import quantize_rows

    g = torch.Generator().manual_seed(7)
    lin = _linear(64, 256, g)
    wq, ws = quantize_rows(lin.weight)
    x = torch.randn(4, 256, generator=g).to(DEVICE, torch.bfloat16)
    xq, xs = quantize_rows(x)
    got = triton_fp8.w8_matmul(xq, wq, ws.reshape(1, -1), triton_fp8.W8Config(64, 64, 4, 2, split_k), x_scale=xs,
                               out_dtype=torch.bfloat16)
    want = (xq.float() * xs) @ (wq.float() * ws.reshape(-1, 1)).t()
    _close(got, want)


@pytest.mark.parametrize("rows", [2, 7])
def test_a_norm_split_around_two_projections_is_the_norm_between_them(rows):
    """o -> add + RMSNorm -> gate/up with the norm in o's and gate/up's epilogues (``triton_fewrow_norm``): the
    output of the separate launches within bf16 rounding, the residual stream's sum bit for bit as the norm kernel
    writes it after the same o, and the per-row squares back to zero for the next norm."""
    from engine.kernels import triton_fewrow_norm as split, triton_layers

    fr = _fewrow()
    g = torch.Generator().manual_seed(rows)
    o, up = _linear(192, 128, g), _linear(256, 192, g)  # 192 = 3 blocks of 64 columns for the squares' atomics
    o.norm_follows = True
    x, r = torch.randn(rows, 128, generator=g).to(DEVICE, torch.bfloat16), torch.randn(rows, 192, generator=g)
    r = r.to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(192, generator=g)).to(DEVICE, torch.bfloat16)
    pending = split.linear(x, o)
    assert isinstance(pending, split.Pending)
    prenormed, total = pending.norm_after(r, w, 1e-5)
    got = split.linear(prenormed, up)
    normed, want_total = triton_layers.add_rmsnorm(pending.resolve(), r, w, 1e-5)  # o on the kernel, unsplit
    _close(got, up(normed))
    assert torch.equal(total, want_total)
    assert not fr._SQUARES[x.device].any() and not fr.counters(x.device).any()
    assert pending.norm_after(None, w, 1e-5) is None  # no residual: the norm resolves it and runs itself
    _close(pending.resolve(), o(x))


def test_linear_takes_only_the_rows_and_dtypes_it_has_tiles_for():
    fr = _fewrow()
    g = torch.Generator().manual_seed(2)
    lin = _linear(64, 128, g)
    x = torch.randn(8, 128, generator=g).to(DEVICE, torch.bfloat16)
    assert fr.takes(x, lin) == (DEVICE == "cuda" and fr.config_for(8, 64, 128) is not None
                                or bool(os.environ.get("TRITON_INTERPRET")))
    assert not fr.takes(x.float(), lin)  # not the weight's dtype
    assert not fr.takes(torch.randn(fr.MAX_ROWS + 1, 128).to(DEVICE, torch.bfloat16), lin)
    assert not fr.takes(x[None], lin)
    if fr.takes(x, lin):
        _close(fr.linear(x, lin), lin(x))


@pytest.mark.usefixtures("few_splits")
def test_tiny_engine_on_the_kernel_gives_the_same_tokens(monkeypatch):
    """Decode steps of three sequences of the tiny model (fp32: bf16's rounding flips its near-tied tokens) with
    every projection on the kernel (split along K), the norms between them split into their epilogues: the greedy
    tokens of the same engine on the torch matmuls."""
    from engine import EngineConfig, SamplingParams
    from engine.decode_path import fewrow_kernels
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.kernels import triton_attention, triton_layers
    from engine.kernels import triton_fewrow_norm as split
    from engine.models.llama import use_kernels

    fr = _fewrow()
    monkeypatch.setattr(fr, "config_for", lambda *a: fr.FewRowConfig(32, 64, 4, 2, 2))  # (no fp32 tiles measured)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = ["hello", "a longer prompt for the tiny model", "third"]

    def run(with_kernel: bool) -> list:
        engine = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="eager", threads=1,
                                     max_num_seqs=4))
        engine.runner.graphs.ops = triton_attention
        use_kernels(engine.model, triton_layers)
        if with_kernel:
            fewrow_kernels(engine.model)
        return [r[1].output_ids for r in generate_many(engine, prompts, [greedy] * 3)]

    want = run(False)
    calls = []
    real, real_after = fr.linear, split.Pending.norm_after
    try:
        fr.linear = lambda x, layer: calls.append(x.shape[0]) or real(x, layer)
        split.Pending.norm_after = lambda *a: calls.append("norm") or real_after(*a)
        got = run(True)
    finally:
        fr.linear, split.Pending.norm_after = real, real_after
    assert got == want
    # per decode step (padded to 4 rows) and layer: o and gate/up around the norm between them, down and the next
    # layer's q/k/v around the next; the first layer's q/k/v and the last one's down on their own
    assert calls.count("norm") >= 4 * (2 * 2 - 1) and sum(1 for rows in calls if rows in (3, 4)) >= 4 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 decode graphs over the kernels run on CUDA")
def test_bf16_batch_decode_graphs_on_the_kernel_match_cublas_on_the_gpu(monkeypatch):
    """The tiny model in bf16, three sequences decoding together in CUDA graphs: projections on the kernel with the
    norms split around them against the same engine on cuBLAS: the same tokens and logprobs (within bf16 noise)
    until the first near-tie, where the token cuBLAS chose is the kernel's runner-up within that noise (random tiny
    weights give flat logits: bf16 sums in another order may flip a tie)."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    prompts = ["hello", "a longer prompt for the tiny model " * 3, "third one"]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    out = {}
    for name in ("kernel", "cublas"):
        monkeypatch.setattr(_fewrow(), "MAX_ROWS", 64 if name == "kernel" else 0)  # read as the graphs are made
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=4, decode_graphs="auto"))
        attn = engine.model.model.layers[0].self_attn
        assert (getattr(attn.qkv_proj, "fewrow", None) is not None) == (name == "kernel")
        engine.warm_up()
        out[name] = [(s.output_ids, list(s.pending_logprobs)) for _, s in generate_many(engine, prompts, [greedy] * 3)]
        assert engine.runner.graphs.replays > 0
    for (ids, lps), (want_ids, want_lps) in zip(out["kernel"], out["cublas"]):
        same = next((i for i, (a, b) in enumerate(zip(ids, want_ids)) if a != b), len(ids))
        torch.testing.assert_close(torch.tensor([lp for _, lp, _ in lps[:same]]),
                                   torch.tensor([lp for _, lp, _ in want_lps[:same]]), atol=0.05, rtol=0.02)
        if same < len(ids):
            runner_up = dict(lps[same][2])
            assert want_ids[same] in runner_up and runner_up[want_ids[same]] > lps[same][1] - 0.05


def test_a_tile_that_does_not_fit_steps_down_to_two_stages_of_64():
    from engine.kernels.tiles import smaller

    fr = _fewrow()
    tile, seen = fr.FewRowConfig(64, 256, 4, 4, 2), []
    while tile is not None:
        seen.append((tile.stages, tile.block_k))
        tile = smaller(tile)
    assert seen == [(4, 256), (3, 256), (2, 256), (2, 128), (2, 64)]


def test_every_shipped_pick_names_a_swept_shape_and_a_tile_the_kernel_takes():
    """``engine/kernels/picks/fewrow-*.json``: keys as ``pick_key`` writes them, tiles of powers of two (or null:
    cuBLAS there), and loaded for that GPU's name."""
    import json
    import re

    from engine.kernels import shipped_picks

    fr = _fewrow()
    files = sorted(shipped_picks.DIR.glob("fewrow-*.json"))
    assert files, "no few-row picks shipped"
    for path in files:
        gpu = path.stem.split("-", 1)[1]
        assert shipped_picks.path_for("fewrow", f"NVIDIA {gpu.upper()} 80GB HBM3") == str(path)
        for key, tile in json.loads(path.read_text()).items():
            kind, rows, n, k = re.fullmatch(r"(bf16|fp8|fp32)-(\d+)x(\d+)x(\d+)", key).groups()
            assert fr.pick_key(kind, int(rows), int(n), int(k)) == key
            if tile is not None:
                config = fr.FewRowConfig(**tile)
                assert all(v > 0 and v & (v - 1) == 0 for v in (config.block_n, config.block_k, config.warps,
                                                                config.split_k)), (key, tile)
