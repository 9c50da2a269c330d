"""Tensor parallelism on the MLX engine: mlx-lm's own model sharding over ``mx.distributed``.

The ranks form a ring group (TCP on loopback; ``PDSERVE_MLX_TP_BACKEND=jaccl``
with a hostfile of Thunderbolt devices on Macs) from a hostfile rank 0 writes;
``model.shard(group)`` splits every attention and MLP over it (the families
whose mlx-lm module has ``shard``: Llama/Mistral, Qwen2, Qwen3, Qwen3-MoE,
DeepSeek-V3). Rank 0 runs the engine and sends each operation that changes
its state, or that runs a forward, on the step plan (``mlx_*`` ops, see
``MlxEngine.follow``); followers replay them on their shard and take rank
0's chosen tokens, so every forward has the same inputs on every rank and
their all-reduces pair up. KV leaves and enters through rank 0 (whole heads:
gathered from the ranks, or split to them)."""
from __future__ import annotations

import json
import os
import tempfile

from control.listen import port_of, reserve

BACKEND_ENV = "PDSERVE_MLX_TP_BACKEND"
RESERVED: list = []  # the hostfile's ports, held bound by rank 0 while it lives (MLX's ring binds them too)


def hostfile(size: int) -> str:
    """A ring hostfile of ``size`` loopback ranks (rank 0 writes it; followers get its path). Its ports are held
    for the ring (``control.listen.reserve``): no other process can take one before its rank binds it."""
    ranks = [reserve("127.0.0.1") for _ in range(size)]
    RESERVED.extend(ranks)
    fd, path = tempfile.mkstemp(prefix="pdserve-mlx-tp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{port_of(sock)}"] for sock in ranks], f)
    return path


def join(path: str, rank: int):
    """This process's MLX group (rank ``rank`` of the hostfile at ``path``)."""
    import mlx.core as mx

    os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = path, str(rank)
    return mx.distributed.init(backend=os.environ.get(BACKEND_ENV, "ring"), strict=True)


def check(model, tp: int) -> None:
    """mlx-lm splits heads evenly (no replication): a clear error when it cannot."""
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm cannot shard {type(model).__module__.rsplit('.', 1)[-1]} models; --tp needs a family "
                         "whose mlx-lm module has shard (llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3)")
    attn = model.layers[0].self_attn
    heads = getattr(attn, "n_heads", None) or getattr(attn, "num_attention_heads")
    kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads")
    if heads % tp or kv % tp:
        fits = [n for n in range(1, kv + 1) if heads % n == 0 and kv % n == 0]
        raise ValueError(f"--tp {tp} does not divide this model's {heads} attention heads / {kv} KV heads on the mlx "
                         f"engine (mlx-lm does not replicate KV heads); use one of {fits}")


def heads_slice(array, rank: int, size: int):
    """Rank ``rank``'s heads of a canonical ``[tokens, heads, dim]`` layer (MLX)."""
    per = array.shape[1] // size
    return array[:, rank * per:(rank + 1) * per, :]
