"""FP8 weights (``--quantization fp8``, ``engine.quant``): the per-row quantization, the FP8 layer against the bf16
one, FP8 checkpoints of three scale layouts loaded, and the clear error off CUDA. The layers run on the CPU here
(torch has ``_scaled_mm`` there; serving refuses it: ``fp8_linear.ALLOW_CPU``); the GPU run is
``bench/gpu/fp8.sh``."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from engine.quant import fp8_linear
from engine.quant.fp8_linear import Fp8Linear, quantize_rows
from tests.checkpoints import write_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fp8_linear, "ALLOW_CPU", True)


def test_rows_quantize_to_their_own_scale():
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]  # rows six orders of magnitude apart
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), 448.0))
    err = ((q.float() * s - x).norm(dim=1) / x.norm(dim=1))
    assert err.max() < 0.04


def test_fp8_layer_matches_the_bf16_layer_within_fp8_error(on_cpu):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (older torch has no per-row FP8 scales on the CPU)
    linear = torch.nn.Linear(256, 128, bias=True).to(device, torch.bfloat16)
    layer = Fp8Linear.of(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.nbytes * 2 == linear.weight.nbytes
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16, device=device)
    want, got = linear(x).float(), layer(x).float()
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()) < 0.06  # weights and activations each ~2.7%


def test_quantization_off_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        Engine(EngineConfig(quantization="fp8", dtype="bfloat16", device="cpu", threads=1))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def _fp8_checkpoint(path, layout: str, plain) -> str:
    """The tiny checkpoint with its projections as e4m3 plus scales laid out as ``layout``, and KV cache scales; at
    ``plain`` the same weights (the values the FP8 ones stand for) in bf16."""
    write_checkpoint(path)
    write_checkpoint(plain)
    state = load_file(os.path.join(path, "model.safetensors"))
    values = dict(state)
    for name in [n for n in state if n.split(".")[-2] in PROJECTIONS]:
        w = state.pop(name).float()
        base = name[:-len("weight")]
        if layout == "channel":
            q, s = quantize_rows(w)
            state[base + "weight_scale"] = s
        elif layout == "tensor":
            s = w.abs().max() / 448
            q, state[base + "weight_scale"] = (w / s).to(torch.float8_e4m3fn), s.reshape(1)
        else:  # 32 x 32 blocks
            blocks = w.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))
            s = blocks.abs().amax(dim=(1, 3)) / 448
            q = (blocks / s[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn)
            state[base + "weight_scale_inv"] = s
            s = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
        state[name] = q
        values[name] = (q.float() * (s.reshape(-1, 1) if s.numel() == q.shape[0] else s)).to(torch.bfloat16)
    for i in range(4):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(state, os.path.join(path, "model.safetensors"))
    save_file(values, os.path.join(plain, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_fp8_checkpoints_load_and_generate(tmp_path, on_cpu, layout):
    path = _fp8_checkpoint(tmp_path / layout, layout, tmp_path / "plain")
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", threads=1, decode_graphs="off"))
    assert engine.quantization == "fp8"  # from the checkpoint's quantization_config
    attn = engine.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and isinstance(engine.model.model.layers[3].mlp.down_proj, Fp8Linear)
    assert [(l.self_attn.k_scale, l.self_attn.v_scale) for l in engine.model.model.layers] == [(0.5 + i, 0.25) for i in range(4)]
    state = load_file(os.path.join(path, "model.safetensors"))
    if layout != "block":  # per-row and per-tensor checkpoints come back to their own codes
        o = engine.model.model.layers[1].self_attn.o_proj
        want = state["model.layers.1.self_attn.o_proj.weight"].to(o.weight.device)
        assert torch.equal(o.weight.view(torch.uint8), want.view(torch.uint8))
    plain = Engine(EngineConfig(model=str(tmp_path / "plain"), dtype="bfloat16", threads=1, decode_graphs="off"))
    want, got = _last_logits(plain), _last_logits(engine)
    finite = torch.isfinite(want) & torch.isfinite(got)
    # the same weight values on both sides: what differs is e4m3 activations (~2.7% per element, per token) through
    # four random layers (measured 0.978-0.991 over the layouts; a wrong scale or code gives ~0)
    assert torch.nn.functional.cosine_similarity(want[finite], got[finite], dim=0) > 0.97


def _last_logits(engine) -> torch.Tensor:
    logits = []
    head = engine.model.logits
    engine.model.logits = lambda h: logits.append(head(h).float()) or logits[-1]
    (_, seq), = generate_many(engine, ["Hello there, tiny model"], [SamplingParams(max_tokens=1, temperature=0)])
    return logits[0][-1]
