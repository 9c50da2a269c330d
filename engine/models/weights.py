"""Weights from a local Hugging Face checkpoint: one ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``, loaded tensor by tensor
into parameters of the same name (``lm_head`` is skipped when tied); a
tensor-parallel shard takes its slice of each (``parallel.layers.shard_of``).
``load_dummy`` draws random weights on the parameters' device instead."""
from __future__ import annotations

import json
import os

import torch

from ..parallel.layers import full_shape, shard_of
from ..quant import checkpoint as fp8_checkpoint


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise ValueError(f"{path} has no model.safetensors nor model.safetensors.index.json")


def load_weights(model: torch.nn.Module, path: str) -> dict:
    """Returns the checkpoint's KV cache scales ``{layer: (k_scale, v_scale)}`` (FP8 checkpoints; else empty)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    tied = getattr(model.spec, "tie_word_embeddings", False)
    missing = set(params) - ({"lm_head.weight"} if tied else set())
    files = checkpoint_files(path)
    scales = _scales(files)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in params:
                    continue
                if tied and name == "lm_head.weight":
                    continue
                tensor, rows = f.get_tensor(name), None
                if tensor.dtype in fp8_checkpoint.FP8_DTYPES:  # an FP8 checkpoint's weight: by its scale
                    rows = fp8_checkpoint.row_scales(tensor, name, scales)
                    tensor = fp8_checkpoint.dequantize(tensor, name, scales, params[name].dtype)
                    if rows is not None:  # the grid fp8_linear quantizes on again (this rank's rows)
                        params[name].fp8_row_scale = _rows_of(rows, model, name)
                tensor = shard_of(tensor, model, name)
                if tensor.shape != params[name].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return fp8_checkpoint.kv_scales(scales)


def _rows_of(rows: torch.Tensor, model: torch.nn.Module, name: str) -> torch.Tensor:
    """This rank's part of a per-row vector of the checkpoint tensor ``name`` (all of it when its columns are split)."""
    owner, _, leaf = name.rpartition(".")
    rule = getattr(model.get_submodule(owner), "tp_slices", {}).get(leaf)
    return rows if rule is None or rule[0] != 0 else shard_of(rows, model, name)


def _scales(files: list[str]) -> dict:
    """Every quantization scale the checkpoint holds, by name (small tensors: read before the weights they scale)."""
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if fp8_checkpoint.is_scale(name)})
    return out


def load_state(model: torch.nn.Module, state: dict) -> None:
    """Copy an in-memory state dict (the built-in tiny model) by name."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                continue
            p.copy_(shard_of(state[name], model, name))


def load_dummy(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights where the parameters are (``--load-format dummy``): normal(0, ``std``), norms 1, no disk.
    Each checkpoint tensor is drawn whole from a generator seeded by its name, then sliced: the same weights at
    any tensor-parallel size (so TP=2 and TP=1 can be compared on a model no checkpoint exists for)."""
    import zlib

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(full_shape(model, name, p), dtype=p.dtype, device=p.device)
            p.copy_(shard_of(full.normal_(0.0, std, generator=gen), model, name))
            del full
