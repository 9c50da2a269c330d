"""Load a model and tokenizer: the built-in tiny model or a local Hugging Face
checkpoint directory (safetensors, sharded too) into pdserve's own model
modules (``engine.models``). HF transformers supplies configs and
tokenizers here and serves as the reference in tests, never as the runtime."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from .config import EngineConfig
from .models import build
from .models.presets import SHAPES, preset_config
from .models.weights import load_dummy, load_state, load_weights
from .parallel.group import SINGLE, TPGroup
from .quant import checkpoint as fp8_checkpoint
from .quant import fp8_linear
from .tiny import TINY_NAME, tiny_weights
from .tokenizer import ByteTokenizer, HFTokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rank_device(name: str, rank: int, size: int) -> torch.device:
    """The device of ``rank`` in a group of ``size``: ``cuda`` (or ``auto`` with GPUs) puts rank r on ``cuda:r``,
    ``cuda:k`` on ``cuda:k+r``, a list (``cuda:0,cuda:1``) rank r on its r-th; CPU ranks share the CPU. More ranks
    than GPUs is an error naming the count."""
    if "," in name:  # one device per rank or stage, as listed (stages may share a GPU: cuda:0,cuda:0)
        devices = name.split(",")
        if len(devices) != size:
            raise ValueError(f"--device {name} names {len(devices)} devices for {size} ranks or stages")
        return pick_device(devices[rank])
    if size == 1:
        return pick_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return pick_device(name)
    first = torch.device(name).index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"--tp {size} from cuda:{first} needs {first + size} GPUs; this machine has {count} "
                         f"(use a smaller --tp or --device cpu)")
    return torch.device("cuda", first + rank)


def pick_device(name: str) -> torch.device:
    """The device named (``cuda`` alone is the current CUDA device, with its index), or the best one present."""
    if name != "auto":
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device, config=None) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    wanted = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return wanted if wanted in (torch.float16, torch.bfloat16) else torch.float16


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    name: str
    max_len: int
    device: torch.device
    dtype: torch.dtype
    suppress: list[int] | None
    quantization: str | None = None  # "fp8": the projections are ``fp8_linear.Fp8Linear``


def load(cfg: EngineConfig, group: TPGroup = SINGLE, device: torch.device | None = None,
         span: tuple[int, int] | None = None) -> Loaded:
    """``span``: only the layers ``[first, end)`` (a pipeline stage; ``engine.pipeline``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = device or pick_device(cfg.device)
    suppress, kv_scales = None, {}
    if cfg.model == TINY_NAME and cfg.load_format != "dummy":
        config, state, suppress = tiny_weights()
        dtype = pick_dtype(cfg.dtype, device)
        model = build(config, group, span)
        load_state(model, state)
        model = model.to(device=device, dtype=dtype)
        tokenizer, name, suppress = ByteTokenizer(), TINY_NAME, suppress or None
    elif os.path.isdir(cfg.model) or cfg.load_format == "dummy":
        config = _config(cfg)
        dtype = pick_dtype(cfg.dtype, device, config)
        model = _empty(config, group, dtype, device, span)
        if cfg.load_format == "dummy":
            load_dummy(model)
        else:
            kv_scales = load_weights(model, cfg.model)
        tokenizer, name, suppress = _tokenizer(cfg)
    else:
        raise ValueError(f"model {cfg.model!r} is neither {TINY_NAME!r} nor a local checkpoint directory "
                         f"(with --load-format dummy also a shape: {', '.join(sorted(SHAPES))})")
    model.fuse()
    model.eval()
    for i, layer in enumerate(model.owned_layers, model.span[0]):
        layer.self_attn.k_scale, layer.self_attn.v_scale = kv_scales.get(i, (1.0, 1.0))
    quantization = cfg.quantization or ("fp8" if fp8_checkpoint.is_fp8_checkpoint(config) else None)
    if quantization == "fp8":
        fp8_linear.check_device(device)
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"--quantization fp8 computes in bf16 or fp16, not {dtype} (give --dtype bfloat16)")
        count = fp8_linear.quantize_model(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 weights just replaced: give their memory to the KV pool
        log.info("FP8 weights: %d projections quantized per output channel", count)
    max_len = getattr(config, "max_position_embeddings", None) or 2048
    if cfg.max_model_len:
        max_len = min(max_len, cfg.max_model_len)
    log.info("loaded %s on %s as %s (context %d)", name, device, dtype, max_len)
    return Loaded(model, tokenizer, cfg.served_name or name, max_len, device, dtype, suppress, quantization)


def _config(cfg: EngineConfig):
    if not os.path.isdir(cfg.model):
        return preset_config(cfg.model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model)


def _empty(config, group: TPGroup, dtype: torch.dtype, device: torch.device, span=None):
    """The model's (shard's) parameters allocated on ``device``, uninitialised, rotary tables computed."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build(config, group, span)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.rotary.reset()
    model.tie()
    return model


def _tokenizer(cfg: EngineConfig):
    """``(tokenizer, served name, suppressed ids)``: a directory's own tokenizer and generation config, else bytes."""
    if not os.path.isdir(cfg.model):
        return ByteTokenizer(), cfg.model, None
    name = os.path.basename(os.path.normpath(cfg.model))
    has_tokenizer = any(os.path.exists(os.path.join(cfg.model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if not has_tokenizer:
        return ByteTokenizer(), name, None
    from transformers import GenerationConfig

    try:
        suppress = list(GenerationConfig.from_pretrained(cfg.model).suppress_tokens or []) or None
    except OSError:
        suppress = None
    return HFTokenizer(cfg.model), name, suppress
