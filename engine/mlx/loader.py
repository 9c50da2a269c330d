"""Loading a model for the MLX engine: the built-in tiny model as mlx-lm's Llama, or a local checkpoint through
mlx-lm's loader (config keys transformers 5 renamed copied back first)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..config import EngineConfig
from ..tiny import TINY_NAME, tiny_weights
from ..tokenizer import ByteTokenizer, HFTokenizer


def _mx():
    try:
        import mlx.core as mx
        if importlib.util.find_spec("mlx_lm") is None:
            raise ImportError("No module named 'mlx_lm'")
    except ImportError as e:
        raise RuntimeError(f"--engine mlx needs mlx and mlx-lm (pip install 'pdserve[mlx]'): {e}") from None
    return mx


def load_mlx(cfg: EngineConfig):
    """``(model, tokenizer, name, max_len, mx dtype, suppress)``."""
    mx = _mx()
    from mlx_lm.utils import load_model

    if cfg.model == TINY_NAME:
        from mlx_lm.models import llama

        tiny, state, suppress = tiny_weights()
        model = llama.Model(llama.ModelArgs.from_dict({**tiny.to_dict(), "model_type": "llama"}))
        model.load_weights([(k, mx.array(v.float().numpy())) for k, v in state.items()])
        tokenizer, name, config = ByteTokenizer(), TINY_NAME, tiny.to_dict()
        suppress = suppress or None
    elif os.path.isdir(cfg.model):
        model, config = load_model(Path(cfg.model), model_config=_legacy_keys(cfg.model))
        tokenizer, name = HFTokenizer(cfg.model), os.path.basename(os.path.normpath(cfg.model))
        suppress = None
    else:
        raise ValueError(f"model {cfg.model!r} is neither {TINY_NAME!r} nor a local checkpoint directory")
    dtype = {"auto": None, "float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[cfg.dtype]
    if dtype is None and cfg.model == TINY_NAME:
        dtype = mx.float32
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    max_len = config.get("max_position_embeddings") or 2048
    if cfg.max_model_len:
        max_len = min(max_len, cfg.max_model_len)
    return model, tokenizer, cfg.served_name or name, max_len, dtype, suppress


def _legacy_keys(path: str) -> dict:
    """Keys mlx-lm reads that transformers 5 writes under other names (``rope_parameters.rope_theta``;
    ``num_local_experts`` for Qwen3-MoE's ``num_experts``), copied to the names mlx-lm expects."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    out = {}
    theta = (c.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in c and theta is not None:
        out["rope_theta"] = theta
    if "num_experts" not in c and "num_local_experts" in c:
        out["num_experts"] = c["num_local_experts"]
    return out
