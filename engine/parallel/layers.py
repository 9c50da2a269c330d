"""Linear layers and embeddings split over a tensor-parallel group.

Each layer records which slice of the checkpoint's full tensors its
parameters hold (``tp_slices``: ``{"weight": (dim, [(start, length), ...])}``,
several ranges for a projection whose rows come from parts of the full one);
the loaders narrow every tensor they read to it (``shard_of``). With a group of one every layer is the plain
one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .group import SINGLE, TPGroup


def mark(module: nn.Module, name: str, dim: int, ranges: list[tuple[int, int]], full: int) -> None:
    """``module.<name>`` holds ``ranges`` along ``dim`` of a checkpoint tensor ``full`` long there."""
    module.__dict__.setdefault("tp_slices", {})[name] = (dim, ranges, full)


def full_shape(model: nn.Module, name: str, param: torch.Tensor) -> list[int]:
    """The checkpoint tensor's shape of which parameter ``name`` holds a slice."""
    owner, _, leaf = name.rpartition(".")
    rule = getattr(model.get_submodule(owner), "tp_slices", {}).get(leaf)
    shape = list(param.shape)
    if rule is not None:
        shape[rule[0]] = rule[2]
    return shape


def shard_of(full: torch.Tensor, model: nn.Module, name: str) -> torch.Tensor:
    """The part of the checkpoint tensor ``name`` that ``model``'s parameter of that name holds (zero-padded past
    the end: a vocabulary split unevenly)."""
    owner, _, leaf = name.rpartition(".")
    rule = getattr(model.get_submodule(owner), "tp_slices", {}).get(leaf)
    if rule is None:
        return full
    dim, ranges, _ = rule
    parts = []
    for start, length in ranges:
        have = max(0, min(length, full.shape[dim] - start))
        part = full.narrow(dim, start, have)
        if have < length:
            pad = list(part.shape)
            pad[dim] = length - have
            part = torch.cat([part, part.new_zeros(pad)], dim=dim)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T`` for this rank's output rows: ``ranges`` of the full output (each ``(start, length)``)."""

    def __init__(self, in_features: int, ranges: list[tuple[int, int]], full: int, bias: bool = False):
        super().__init__(in_features, sum(n for _, n in ranges), bias=bias)
        mark(self, "weight", 0, ranges, full)
        if bias:
            mark(self, "bias", 0, ranges, full)


class RowParallelLinear(nn.Linear):
    """``y = sum over ranks of x_r W_r^T``: this rank's input columns ``[start, start + length)``, an all-reduce."""

    def __init__(self, start: int, length: int, full: int, out_features: int, group: TPGroup = SINGLE):
        super().__init__(length, out_features, bias=False)
        mark(self, "weight", 1, [(start, length)], full)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def vocab_slice(vocab_size: int, group: TPGroup) -> tuple[int, int]:
    """This rank's rows of the vocabulary: ``(start, rows)``, every rank the same count (the last padded)."""
    rows = -(-vocab_size // group.size)
    return group.rank * rows, rows


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + rows)`` of the embedding here; other ids give zeros, the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden: int, group: TPGroup = SINGLE):
        self.start, rows = vocab_slice(vocab_size, group)
        # uninitialised (weights are loaded): nn.Embedding's own init on the meta device imports torch._dynamo (~2 s)
        super().__init__(rows, hidden, _weight=torch.empty(rows, hidden))
        mark(self, "weight", 0, [(self.start, rows)], vocab_size)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered from every rank into the full ``[..., vocab_size]``."""

    def __init__(self, hidden: int, vocab_size: int, group: TPGroup = SINGLE):
        start, rows = vocab_slice(vocab_size, group)
        super().__init__(hidden, rows, bias=False)
        mark(self, "weight", 0, [(start, rows)], vocab_size)
        self.group, self.vocab_size = group, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last(F.linear(x, self.weight))
        return logits[..., :self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
