"""Which engine a worker runs: the torch engine, or the MLX one (``--engine mlx``; ``auto`` picks it on macOS
when mlx-lm is installed)."""
from __future__ import annotations

import importlib.util
import sys

from .config import EngineConfig


def engine_kind(cfg: EngineConfig) -> str:
    if cfg.engine != "auto":
        return cfg.engine
    return "mlx" if sys.platform == "darwin" and importlib.util.find_spec("mlx_lm") is not None else "torch"


def make_engine(cfg: EngineConfig, **kw):
    if engine_kind(cfg) == "mlx":
        from .mlx.engine import MlxEngine

        kw.pop("pool_memory", None)
        kw.pop("tp_kv", None)
        return MlxEngine(cfg, **kw)
    from .engine import Engine

    return Engine(cfg, **kw)
