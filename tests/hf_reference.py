"""Hugging Face transformers as the reference the engine is tested against:
the same weights in HF's own model classes, one sequence at a time, greedy."""
from __future__ import annotations

import torch


def hf_model(path_or_model):
    if isinstance(path_or_model, str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32).eval()
    return path_or_model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int, suppress=None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs (log-softmax of the model's scores) from HF with a DynamicCache."""
    from transformers import DynamicCache

    cache, ids, out_ids, logprobs = DynamicCache(), torch.tensor([prompt_ids]), [], []
    for _ in range(max_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        if suppress:
            logits[suppress] = float("-inf")
        token = int(torch.argmax(logits))
        out_ids.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids = torch.tensor([[token]])
    return out_ids, logprobs
