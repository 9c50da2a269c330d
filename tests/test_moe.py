"""Mixture-of-experts models served as any other: tiny random Mixtral and Qwen3-MoE checkpoints (fp32) through
``pdserve up`` disaggregated over tcp and colocated give the in-process engine's greedy tokens (which
``test_paged_engine`` holds to Hugging Face's); the routing itself against a dense computation; an unknown
architecture names the supported ones, the MoE families among them."""
import httpx
import pytest
import torch

from deploy.local import Cluster
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate
from engine.models import build
from engine.models.moe import MoESpec, SparseMoE
from tests.test_paged_engine import write_family

PROMPTS = ["Hello", "The capital of France is", "x" * 200]


def test_routing_and_expert_sum_match_a_dense_computation():
    """Every expert run on every token, weighted by the top-k (renormalized) softmax and zero elsewhere."""
    torch.manual_seed(0)
    spec = MoESpec("qwen3_moe", num_experts=5, top_k=2, inter=24, normalize=True, scores_in_fp32=False,
                   sparse_layers=(0,))
    moe = SparseMoE(16, spec)
    for p in moe.parameters():
        p.data.normal_(0, 0.5)
    moe.fuse()
    x = torch.randn(7, 16)
    probs = torch.softmax(moe.gate(x), dim=-1)
    top = probs.topk(2, dim=-1)
    dense = torch.zeros_like(probs).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    outs = []
    for e in range(5):
        h = x @ moe.w_gate_up[e].t()
        outs.append((torch.nn.functional.silu(h[:, :24]) * h[:, 24:]) @ moe.w_down[e].t())
    want = sum(dense[:, e, None] * outs[e] for e in range(5))
    torch.testing.assert_close(moe(x), want, atol=1e-5, rtol=1e-5)


def test_unknown_architecture_names_the_moe_families_too():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        build(GPT2Config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_disaggregated_and_colocated_moe_equal_the_engine(tmp_path, family):
    path = write_family(tmp_path, family)
    runner = Engine(EngineConfig(model=path, threads=1))
    clusters = [Cluster("--model", path), Cluster("--model", path, "--colocated")]
    try:
        for c in clusters:
            c.wait_ready()
        for prompt in PROMPTS:
            want = generate(runner, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[1]
            for c in clusters:
                r = httpx.post(c.url + "/v1/completions", json={
                    "model": runner.name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want
        body = r.json()
        assert body["pdserve"]["transport"] == "none"  # the last one: colocated
    finally:
        for c in clusters:
            c.stop()
