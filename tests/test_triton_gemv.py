"""The one-row projection kernel (``engine.kernels.triton_gemv``, batch-1 decode) against the launches it replaces: the norm (with the
residual add), the GEMM, SiLU-times-up and the FP8 activations' quantization, on a GPU or under Triton's
interpreter (set when there is no GPU; CI runs them so)."""
import os

import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton
DTYPE = torch.bfloat16


def _gemv():
    from engine.kernels import triton_gemv

    return triton_gemv


def _linear(out_f: int, in_f: int, g, bias: bool = False) -> torch.nn.Linear:
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * in_f ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    return lin.to(DEVICE, DTYPE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding of the output (the sums run in another order than the reference's)."""
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_a_row_matches_the_linear_layer(bias, ahead):
    g = torch.Generator().manual_seed(2)
    lin = _linear(96, 200, g, bias)  # K not a multiple of the tile: masked
    x = torch.randn(1, 200, generator=g).to(DEVICE, DTYPE)
    got = _gemv().linear(x, lin, config=_gemv().GemvConfig(32, 64, 4, 2, ahead))
    assert got.shape == (1, 96) and got.dtype == DTYPE
    _close(got, lin(x))
    assert _gemv().takes(x) == (DEVICE == "cuda" or bool(os.environ.get("TRITON_INTERPRET")))
    assert not _gemv().takes(torch.randn(2, 200).to(DEVICE, DTYPE))  # more rows: the separate launches


@pytest.mark.parametrize("residual,ahead", [(False, 1), (True, 1), (True, 2)])
def test_a_deferred_norm_is_normed_as_the_norm_kernel_norms(residual, ahead):
    """``Normed`` -> the projection of ``add_rmsnorm`` (or ``rmsnorm``); program 0 writes the residual sum exactly."""
    from engine.kernels import triton_layers

    gemv = _gemv()
    g = torch.Generator().manual_seed(7)
    lin = _linear(80, 256, g)
    x, r = (torch.randn(1, 256, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(DEVICE, DTYPE)
    if residual:
        normed, total = gemv.defer(x, r, w, 1e-5)
        want_h, want_total = triton_layers.add_rmsnorm(x, r, w, 1e-5)
    else:
        normed, total, want_h, want_total = gemv.defer(x, None, w, 1e-5), None, triton_layers.rmsnorm(x, w, 1e-5), None
    assert gemv.takes(normed)
    got = gemv.linear(normed, lin, config=gemv.GemvConfig(16, 64, 4, 2, ahead))  # more programs than one: each norms
    _close(got, lin(want_h))
    if residual:
        assert torch.equal(total, want_total)


@pytest.mark.parametrize("ahead", [1, 2])
def test_gate_up_with_silu_is_the_mlp(ahead):
    from engine.kernels import triton_layers

    gemv = _gemv()
    g = torch.Generator().manual_seed(3)
    gate_up = _linear(2 * 112, 64, g)  # 112 outputs: the last tile masked
    x, r = (torch.randn(1, 64, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    w = torch.ones(64, dtype=DTYPE, device=DEVICE)
    normed, _ = gemv.defer(x, r, w, 1e-6)
    got = gemv.linear(normed, gate_up, silu=True, config=gemv.GemvConfig(32, 16, 4, 2, ahead))  # 4 K tiles
    h, _ = triton_layers.add_rmsnorm(x, r, w, 1e-6)
    _close(got, triton_layers.silu_mul(gate_up(h)))


@pytest.mark.parametrize("norm,ahead", [(False, 1), (True, 1), (True, 2)])
def test_fp8_weights_give_the_scaled_mm_numbers(norm, ahead):
    """W8A8 as ``Fp8Linear`` computes it: the rows (normed first) quantized per row, the products, both scales.
    (The rows quantized by ``triton_quant``: under the interpreter its e4m3 cast rounds as the kernel's does.)"""
    from engine.kernels import triton_layers
    from engine.kernels.triton_quant import quantize_rows
    from engine.quant.fp8_linear import Fp8Linear

    gemv = _gemv()
    g = torch.Generator().manual_seed(11)
    lin = Fp8Linear.of(_linear(64, 192, g))
    x, r = (torch.randn(1, 192, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(192, generator=g)).to(DEVICE, DTYPE)
    rows, h = (gemv.defer(x, r, w, 1e-5)[0], triton_layers.add_rmsnorm(x, r, w, 1e-5)[0]) if norm else (x, x)
    got = gemv.linear(rows, lin, config=gemv.GemvConfig(32, 64, 4, 2, ahead))
    xq, xs = quantize_rows(h)
    want = (xq.float() * xs) @ (lin.weight.float() * lin.weight_scale.reshape(-1, 1)).t()
    _close(got, want)


def batch1_on_the_kernels():
    """``(engine, run, want)``: the tiny model (fp32) with its batch-1 decode steps on the Triton kernels and the
    GEMV; ``run()`` generates greedily for two prompts one at a time, ``want`` is what the torch forms give."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many
    from engine.kernels import triton_attention, triton_layers
    from engine.models.llama import use_kernels

    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = ["hello", "a longer prompt for the tiny model"]
    plain = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="off", threads=1))
    want = [generate_many(plain, [p], [greedy])[0][1].output_ids for p in prompts]
    fast = Engine(EngineConfig(device=DEVICE, dtype="float32", decode_graphs="eager", threads=1, max_num_seqs=4))
    fast.runner.graphs.ops = triton_attention
    use_kernels(fast.model, triton_layers, _gemv())
    return fast, lambda: [generate_many(fast, [p], [greedy])[0][1].output_ids for p in prompts], want


@pytest.mark.usefixtures("few_splits")
def test_tiny_engine_with_the_gemv_kernel_gives_the_same_tokens():
    """Every batch-1 decode step of the tiny model (fp32) through the kernel: the norms deferred into q/k/v and
    gate/up, SiLU-times-up fused, o and down on it; the same greedy tokens as the torch forms."""
    _, run, want = batch1_on_the_kernels()
    calls = []
    real = _gemv().linear
    try:
        _gemv().linear = lambda *a, **k: calls.append(k.get("silu", False)) or real(*a, **k)
        got = run()
    finally:
        _gemv().linear = real
    assert got == want
    assert calls.count(True) >= 2 * 4 * 4 and calls.count(False) >= 3 * 2 * 4 * 4  # per step and layer: gate/up;
    # q/k/v, o, down


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 decode graphs over the kernels run on CUDA")
def test_bf16_engine_on_the_gemv_kernel_matches_torch_on_the_gpu():
    """The tiny model in bf16: batch-1 decode graphs over the GEMV kernel (and PDL, where the GPU has it) against
    the torch forms: the same greedy tokens, their logprobs within bf16 noise."""
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    prompts, out = ["hello", "a longer prompt for the tiny model " * 3], {}
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for name, graphs in (("torch", "off"), ("kernels", "auto")):
        engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", threads=1, max_num_seqs=4, decode_graphs=graphs))
        engine.warm_up()
        seqs = [generate_many(engine, [p], [greedy])[0][1] for p in prompts]  # batch 1
        out[name] = [(s.output_ids, [lp for _, lp, _ in s.pending_logprobs]) for s in seqs]
        if graphs == "auto":
            assert engine.runner.graphs.replays > 0 and engine.model.model.layers[0].mlp.gemv is not None
    for (ids, lps), (want_ids, want_lps) in zip(out["kernels"], out["torch"]):
        assert ids == want_ids and len(lps) == len(want_lps) == 8
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=0.05, rtol=0.02)


def test_the_picks_shipped_for_this_gpu_are_used_unless_a_file_is_named(tmp_path, monkeypatch):
    import json

    from engine.kernels import shipped_picks

    assert shipped_picks.gpu_model("NVIDIA H100 80GB HBM3") == "h100"
    assert shipped_picks.gpu_model("NVIDIA H200") == "h200"
    assert shipped_picks.gpu_model("NVIDIA A100-SXM4-80GB") == "a100"
    assert shipped_picks.gpu_model("cpu") == ""
    (tmp_path / "gemv-h100.json").write_text(json.dumps({"3072x4096": {"block_n": 4, "block_k": 1024, "warps": 8,
                                                                          "stages": 2}}))
    monkeypatch.setattr(shipped_picks, "DIR", tmp_path)
    assert shipped_picks.path_for("gemv", "NVIDIA H100 80GB HBM3") == str(tmp_path / "gemv-h100.json")
    assert shipped_picks.path_for("gemv", "NVIDIA H200") is None
    gemv = _gemv()
    monkeypatch.setattr(gemv, "_PICKS", {})
    monkeypatch.setattr(shipped_picks, "_loaded", set())
    monkeypatch.setattr(shipped_picks, "path_for", lambda kernel: shipped_picks.DIR / f"{kernel}-h100.json")
    monkeypatch.delenv("PDSERVE_GEMV_CONFIGS", raising=False)
    assert gemv.config_for(3072, 4096, False, False) == gemv.GemvConfig(4, 1024, 8, 2)
    assert gemv.config_for(4096, 2048, False, False) == gemv.GemvConfig(8, 256, 4, 3)  # not swept: by kind


def test_the_gemv_builds_for_hopper():
    """The variants the engine launches on an H100/H200 (PDL on, the norm and residual add fused; one and two
    tiles ahead; gate/up with SiLU; FP8 weights) built for sm_90a."""
    from tests.triton_env import compile_for_hopper

    cases = []
    for ahead, silu, fp8, push in [(1, False, False, False), (2, False, False, False), (2, True, False, False),
                                   (2, False, True, False), (1, False, False, True)]:
        w = "*fp8e4nv" if fp8 else "*bf16"
        sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "sum_ptr": "*bf16", "w_ptr": w,
               "ws_ptr": "*fp32" if fp8 else w, "b_ptr": w, "out_ptr": "*bf16", "eps": "fp32", "push_ptr": "*i64",
               "step_ptr": "*i32", "site": "i32"}
        flags = dict(N=3072, K=4096, ADD=True, NORM=True, FP8=fp8, SILU=silu, BIAS=False, PDL=True,
                     PUSH=push, RANK=1, WORLD=2, CAP=4096, BLOCK_N=8, BLOCK_K=256, AHEAD=ahead)
        cases.append(("engine.kernels.triton_gemv", "_one_row_kernel", sig, flags))
    for case, built in zip(cases, compile_for_hopper(cases)):
        assert "error" not in built, (case[3], built.get("error"))
        assert built["cubin_bytes"] > 0 and "griddepcontrol.wait" in built["ptx"]
        if case[3]["PUSH"]:  # the tagged words go out as 32-bit stores
            assert "st.global.b32" in built["ptx"] or "st.global.u32" in built["ptx"]
