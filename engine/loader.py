"""Load a model and tokenizer: the built-in tiny model or a local Hugging Face
checkpoint directory (safetensors)."""
from __future__ import annotations

import logging
import os

import torch

from .config import EngineConfig
from .tiny import TINY_NAME, build_tiny_model
from .tokenizer import ByteTokenizer, HFTokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    return torch.float32 if device.type == "cpu" else torch.float16


def load(cfg: EngineConfig):
    """Returns ``(model, tokenizer, served_name, max_len, device, dtype)``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.model == TINY_NAME:
        model, tokenizer, name = build_tiny_model(), ByteTokenizer(), TINY_NAME
    elif os.path.isdir(cfg.model):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).eval()
        tokenizer, name = HFTokenizer(cfg.model), os.path.basename(os.path.normpath(cfg.model))
    else:
        raise ValueError(f"model {cfg.model!r} is neither {TINY_NAME!r} nor a local checkpoint directory")
    model = model.to(device=device, dtype=dtype)
    max_len = getattr(model.config, "max_position_embeddings", None) or 2048
    if cfg.max_model_len:
        max_len = min(max_len, cfg.max_model_len)
    log.info("loaded %s on %s as %s (context %d)", name, device, dtype, max_len)
    return model, tokenizer, cfg.served_name or name, max_len, device, dtype
