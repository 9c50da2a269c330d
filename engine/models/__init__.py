"""Model families by Hugging Face architecture name."""
from __future__ import annotations

from .llama import LlamaForCausalLM, ModelSpec

ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"moe": "mixtral"},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": "qwen3_moe"},
}


BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def build(hf_config, group=None, span=None) -> LlamaForCausalLM:
    """The model of ``hf_config`` (this rank's shard of it with a tensor-parallel ``group``; the layers
    ``[first, end)`` of a pipeline stage with ``span``)."""
    arch = (getattr(hf_config, "architectures", None) or [BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""), "?")])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    spec = ModelSpec.from_hf(hf_config, **ARCHITECTURES[arch])
    return LlamaForCausalLM(spec, span=span) if group is None else LlamaForCausalLM(spec, group, span)
