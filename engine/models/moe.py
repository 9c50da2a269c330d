"""Mixture-of-experts feed-forward blocks: Mixtral and Qwen3-MoE.

A router (``gate``, one linear layer) scores every expert per token; the
softmax over all experts in fp32 picks the ``top_k`` best, whose weights are
renormalized to sum to one (Mixtral always; Qwen3-MoE with
``norm_topk_prob``). Each expert is a SwiGLU MLP (``down(silu(gate x) * up
x)``); a token's output is the weighted sum of its experts'. Checkpoints hold
each expert under its own name (Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``,
Qwen3-MoE ``mlp.experts.E.gate_proj/up_proj/down_proj``): they load by name
into per-expert layers, and ``fuse`` stacks them into one ``[experts, 2 *
inter, hidden]`` gate/up tensor and one ``[experts, hidden, inter]`` down
tensor. ``forward`` runs the reference path (a loop over the experts the batch
hit, tokens gathered and scattered back: the CPU, and what the CUDA kernels of
``kernels.triton_moe`` are checked against). Under tensor parallelism each rank holds its slice of every
expert's intermediate width (gate/up rows, down columns) and the block's
output is all-reduced once."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import SINGLE, TPGroup
from ..parallel.layers import mark

NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
         "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


@dataclass(frozen=True)
class MoESpec:
    family: str  # a key of NAMES
    num_experts: int
    top_k: int
    inter: int  # each expert's intermediate width
    normalize: bool  # renormalize the top-k weights
    scores_in_fp32: bool  # Mixtral weighs the expert outputs in fp32, Qwen3-MoE in the model's dtype
    sparse_layers: tuple  # which layers are MoE (the others dense)

    @classmethod
    def from_hf(cls, c, family: str) -> "MoESpec":
        if family == "mixtral":
            return cls(family, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, True, True,
                       tuple(range(c.num_hidden_layers)))
        step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or [])
        layers = tuple(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        return cls(family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   bool(getattr(c, "norm_topk_prob", False)), False, layers)

    @property
    def module_name(self) -> str:
        return NAMES[self.family][0]


class Expert(nn.Module):
    """One expert's three projections under the checkpoint's names (until ``SparseMoE.fuse`` stacks them)."""

    def __init__(self, hidden: int, part: int, start: int, inter: int, names: tuple):
        super().__init__()
        self.names = names
        gate, up, down = (nn.Linear(hidden, part, bias=False), nn.Linear(hidden, part, bias=False),
                          nn.Linear(part, hidden, bias=False))
        for name, layer in zip(names, (gate, up, down)):
            setattr(self, name, layer)
        mark(gate, "weight", 0, [(start, part)], inter)
        mark(up, "weight", 0, [(start, part)], inter)
        mark(down, "weight", 1, [(start, part)], inter)


class SparseMoE(nn.Module):
    kernels = None  # ``kernels.triton_moe`` on CUDA (the engine sets it): grouped GEMMs, no host synchronization

    def __init__(self, hidden: int, m: MoESpec, group: TPGroup = SINGLE):
        super().__init__()
        if m.inter % group.size:
            raise ValueError(f"--tp {group.size} does not divide the experts' width {m.inter}")
        self.m, self.group = m, group
        part = m.inter // group.size
        self.gate = nn.Linear(hidden, m.num_experts, bias=False)  # the router, whole on every rank
        self.experts = nn.ModuleList(Expert(hidden, part, group.rank * part, m.inter, NAMES[m.family][1])
                                     for _ in range(m.num_experts))
        self.w_gate_up = self.w_down = None

    def fuse(self) -> None:
        """Stack the experts' weights: ``w_gate_up`` ``[E, 2 * part, hidden]`` (gate rows, then up), ``w_down``
        ``[E, hidden, part]``."""
        g, u, d = (self.experts[0].names[i] for i in range(3))
        self.w_gate_up = nn.Parameter(torch.stack([torch.cat([getattr(e, g).weight.data, getattr(e, u).weight.data])
                                                   for e in self.experts]), requires_grad=False)
        self.w_down = nn.Parameter(torch.stack([getattr(e, d).weight.data for e in self.experts]), requires_grad=False)
        del self.experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [tokens, top_k], expert ids [tokens, top_k])``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.m.top_k, dim=-1)
        if self.m.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.m.scores_in_fp32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        run = self.kernels.experts if self.kernels is not None else experts_reference
        return self.group.all_reduce(run(x, weights, ids, self.w_gate_up, self.w_down))


def experts_reference(x, weights, ids, w_gate_up, w_down) -> torch.Tensor:
    """Each token's weighted sum of its experts' SwiGLU outputs: a loop over the experts hit (gather, two matmuls,
    scatter-add), in the model's dtype as the Hugging Face models compute it."""
    out = torch.zeros_like(x)
    part = w_down.shape[-1]
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], w_gate_up[e])
        h = F.silu(h[:, :part]) * h[:, part:]
        y = F.linear(h, w_down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
