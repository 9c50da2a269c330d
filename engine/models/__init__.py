"""Model families by Hugging Face architecture name."""
from __future__ import annotations

from .llama import LlamaForCausalLM, ModelSpec

ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def build(hf_config) -> LlamaForCausalLM:
    arch = (getattr(hf_config, "architectures", None) or [BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""), "?")])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return LlamaForCausalLM(ModelSpec.from_hf(hf_config, **ARCHITECTURES[arch]))
