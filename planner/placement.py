"""``pdserve plan placement``: which contiguous layers each node of a pipeline holds, so that every node fits
its weights plus the KV of the whole context.

Per layer: its weights (attention, MLP or every expert, norms; at ``bits`` per weight plus a 16-bit scale and
bias per group of ``group`` weights when quantized) and its KV for ``max_model_len`` tokens of each of
``max_num_seqs`` sequences. The first node also holds the embedding, the final norm and the LM head (pdserve's
stage 0 schedules and samples: the last stage hands its hidden states back to it; a tied head costs nothing more).
A node offers ``memory x usable - reserve`` (the OS, activations, the runtime; ``usable`` by default what
macOS lets Metal wire: about two thirds of 36 GB or less, three quarters above; give 0.9 for GPUs). Layers are shared in proportion
to each node's speed (given as ``name:memGB:speed``) or, without speeds, its capacity, then moved off any node
they do not fit onto nodes with room; a cluster that cannot hold every layer with its KV is refused with the
numbers. The weights-only placement (layers in proportion to memory, KV not counted) is reported beside it with
the context each node could then hold: the placement that ran out of memory on a 36 GB MacBook at ~21k tokens
(this shape gives ~46k there, before activations)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

GB = 1e9
# shapes for placement only (the engine does not run these architectures), besides engine.models.presets
PLACEMENT_SHAPES = {
    "minimax-m2-230b": dict(vocab_size=200064, hidden_size=3072, num_hidden_layers=62, num_attention_heads=48,
                            num_key_value_heads=8, head_dim=128, intermediate_size=1536, num_local_experts=256,
                            num_experts_per_tok=8),
}


@dataclass
class Node:
    name: str
    memory_gb: float
    speed: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Node":
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3) or not parts[0]:
                raise ValueError
            node = cls(parts[0], float(parts[1]), float(parts[2]) if len(parts) == 3 else None)
        except ValueError:
            raise ValueError(f"node {text!r} is not name:memGB[:speed]") from None
        if node.memory_gb <= 0 or (node.speed is not None and node.speed <= 0):
            raise ValueError(f"node {text!r}: memory and speed must be positive")
        return node


@dataclass
class Shape:
    """Bytes of a model by part: per layer (weights; KV per token), and the embedding and head."""
    layers: int
    layer_weight_bytes: float
    kv_bytes_per_token_layer: float
    embed_bytes: float
    head_bytes: float

    @classmethod
    def of(cls, config: dict, bytes_per_weight: float, kv_bytes: float = 2.0) -> "Shape":
        h, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or h // heads
        attention = h * head_dim * (2 * heads + 2 * kv_heads)
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        if experts:
            width = config.get("moe_intermediate_size") or config["intermediate_size"]
            mlp = experts * 3 * h * width + h * experts
        else:
            mlp = 3 * h * config["intermediate_size"]
        vocab = config["vocab_size"]
        head = 0 if config.get("tie_word_embeddings") else vocab * h * bytes_per_weight
        return cls(layers, (attention + mlp) * bytes_per_weight + 2 * h * 2, 2 * kv_heads * head_dim * kv_bytes,
                   vocab * h * bytes_per_weight, head + h * 2)

    @property
    def weight_bytes(self) -> float:
        return self.layers * self.layer_weight_bytes + self.embed_bytes + self.head_bytes


def model_config(model: str) -> dict:
    """A preset's or a checkpoint directory's config (``config.json``)."""
    if os.path.isdir(model):
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        return config.get("text_config", config)
    if model in PLACEMENT_SHAPES:
        return PLACEMENT_SHAPES[model]
    from engine.tiny import TINY_CONFIG, TINY_NAME

    if model == TINY_NAME:
        return TINY_CONFIG
    from engine.models.presets import SHAPES

    if model not in SHAPES:
        raise ValueError(f"no model {model!r}: a checkpoint directory, or one of "
                         f"{', '.join(sorted([*SHAPES, *PLACEMENT_SHAPES]))}")
    return SHAPES[model][1]


def bytes_per_weight(dtype: str, bits: int | None, group: int = 64) -> float:
    if bits is not None:
        return (bits + 32 / group) / 8  # an fp16 scale and bias per group (MLX's affine quantization)
    return {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}[dtype]


@dataclass
class Stage:
    node: Node
    first: int
    last: int  # exclusive
    weights_gb: float
    kv_gb: float
    capacity_gb: float
    max_tokens: int  # KV tokens (all sequences together) its layers can hold in what the weights leave

    @property
    def layers(self) -> int:
        return self.last - self.first

    @property
    def fits(self) -> bool:
        return self.weights_gb + self.kv_gb <= self.capacity_gb + 1e-9


class PlacementError(ValueError):
    pass


def usable_share(memory_gb: float) -> float:
    """What macOS lets the GPU wire by default (``recommendedMaxWorkingSetSize``), roughly."""
    return 0.67 if memory_gb <= 36 else 0.75


def capacities(nodes: list[Node], usable: float | None, reserve_gb: float) -> list[float]:
    return [max(0.0, n.memory_gb * (usable or usable_share(n.memory_gb)) - reserve_gb) * GB for n in nodes]


def stages_for(nodes: list[Node], counts: list[int], shape: Shape, tokens: int, caps: list[float]) -> list[Stage]:
    out, first = [], 0
    for i, (node, n) in enumerate(zip(nodes, counts)):
        extra = shape.embed_bytes + shape.head_bytes if i == 0 else 0
        weights = n * shape.layer_weight_bytes + extra
        per_token = n * shape.kv_bytes_per_token_layer
        room = max(0.0, caps[i] - weights)
        out.append(Stage(node, first, first + n, weights / GB, per_token * tokens / GB, caps[i] / GB,
                         int(room / per_token) if per_token else 0))
        first += n
    return out


def proportional(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[:total - sum(counts)]:
        counts[i] += 1
    return counts


def place(nodes: list[Node], shape: Shape, tokens: int, usable: float | None = None,
          reserve_gb: float = 2.0) -> list[Stage]:
    """Contiguous layer ranges, one per node in order, each fitting its weights and the KV of ``tokens``."""
    caps = capacities(nodes, usable, reserve_gb)
    per_layer = shape.layer_weight_bytes + shape.kv_bytes_per_token_layer * tokens
    extras = [shape.embed_bytes + shape.head_bytes if i == 0 else 0 for i in range(len(nodes))]
    most = [max(0, int((c - e) // per_layer)) for c, e in zip(caps, extras)]
    if sum(most) < shape.layers or any(c < e for c, e in zip(caps, extras)):
        need = shape.weight_bytes + shape.layers * shape.kv_bytes_per_token_layer * tokens
        raise PlacementError(
            f"the cluster cannot hold this model with {tokens:,} tokens of KV: it needs {need / GB:.1f} GB (weights "
            f"{shape.weight_bytes / GB:.1f} GB + KV {(need - shape.weight_bytes) / GB:.1f} GB), the nodes offer "
            f"{sum(caps) / GB:.1f} GB ({', '.join(f'{n.name} {c / GB:.1f}' for n, c in zip(nodes, caps))}: memory "
            f"x {usable or 'the default share'} - {reserve_gb:g} GB); at most {sum(most)} of {shape.layers} layers "
            "fit. Shorten "
            "--max-model-len, lower --max-num-seqs, quantize, or add a node")
    if shape.layers < len(nodes) or not all(most):
        short = [n.name for n, m in zip(nodes, most) if not m]
        raise PlacementError(f"every stage needs a layer: {', '.join(short) or 'the model'} "
                             f"{'cannot hold one with its KV' if short else f'has only {shape.layers}'}")
    counts = proportional(shape.layers, [n.speed or c for n, c in zip(nodes, caps)])
    counts = [max(1, min(c, m)) for c, m in zip(counts, most)]  # a stage holds a layer at least
    while sum(counts) > shape.layers:
        counts[max(range(len(counts)), key=lambda i: counts[i])] -= 1
    while sum(counts) < shape.layers:  # what did not fit goes to the nodes with room, in the same proportion
        room = [m - c for c, m in zip(counts, most)]
        share = proportional(shape.layers - sum(counts), [(n.speed or cap) if r else 0.0
                                                          for n, cap, r in zip(nodes, caps, room)])
        counts = [c + min(s, r) for c, s, r in zip(counts, share, room)]
    return stages_for(nodes, counts, shape, tokens, caps)


def place_stage_zero(nodes: list[Node], shape: Shape, tokens: int, usable: float | None = None,
                     reserve_gb: float = 2.0) -> list[Stage]:
    """``place`` in the order given; when that does not fit, with another node first (stage 0 also holds the
    embedding and the LM head, which can tip a tight cluster), the rest in their order. Refuses as ``place``."""
    try:
        return place(nodes, shape, tokens, usable, reserve_gb)
    except PlacementError as first_error:
        for i in range(1, len(nodes)):
            try:
                return place([nodes[i], *nodes[:i], *nodes[i + 1:]], shape, tokens, usable, reserve_gb)
            except PlacementError:
                continue
        raise first_error from None


def weights_only(nodes: list[Node], shape: Shape, tokens: int, usable: float | None = None,
                 reserve_gb: float = 2.0) -> list[Stage]:
    """Layers in proportion to memory with no room kept for the KV (what each node then holds is reported)."""
    caps = capacities(nodes, usable, reserve_gb)
    return stages_for(nodes, proportional(shape.layers, [n.memory_gb for n in nodes]), shape, tokens, caps)


def table(stages: list[Stage]) -> str:
    rows = ["| node | memory GB | layers | weights GB | KV GB | usable GB | fits | KV tokens it can hold |",
            "|---|---|---|---|---|---|---|---|"]
    for s in stages:
        rows.append(f"| {s.node.name} | {s.node.memory_gb:g} | {s.first}-{s.last - 1} ({s.layers}) | "
                    f"{s.weights_gb:.1f} | {s.kv_gb:.1f} | {s.capacity_gb:.1f} | {'yes' if s.fits else 'NO'} | "
                    f"{s.max_tokens:,} |")
    return "\n".join(rows)
