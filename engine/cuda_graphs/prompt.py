"""A fresh prompt's first chunk run from a CUDA graph, not launch by launch.

An eager forward launches some 25 kernels a layer; for a prompt of a few
hundred tokens the host takes longer to launch them than the GPU to run
them (a 512-token prompt on an H200: 12 ms of GPU work, 22-40 ms of step
depending on the host). So the engine also captures the forward of one
prompt chunk of ``T`` tokens for ``T`` in ``token_buckets`` (eight sizes per
doubling from 16 up to ``PDSERVE_PROMPT_GRAPH_TOKENS``, default 1024: above
it a prompt keeps the GPU busy launched eagerly), and a step whose only row
is a prompt chunk that samples and wants no prompt logprobs replays the
smallest graph with more than its ``n`` tokens instead. From position 0:

* ids, positions and KV slots go to static buffers; tokens ``n..T-1`` are
  padding with slot -1 (``rope_store`` writes nothing for them);
* attention is the varlen kernel over two packed sequences, the prompt
  ``[0, n)`` and the padding ``[n, T)`` (cumulative starts in a device
  buffer, the longest fixed at ``T``), so the padding never reaches the
  prompt's keys and the prompt's scores are those of a launch of ``n``;
* the logits are those of row ``n - 1`` only (an index buffer).

A chunk after a cached prefix (a chat turn whose history is in the pool,
up to ``CACHED_MAX_TOKENS`` new tokens) replays a graph per (token bucket,
context bucket ``C``: 512, 1024, ... up to ``PDSERVE_PROMPT_GRAPH_CONTEXT``,
8192): the keys of its whole context are gathered from the pool through its
block table (a static buffer; past the context, block 0) and attend as in
the eager step (``attention.varlen_cached``, causal from the bottom right),
the padding again a second sequence, over the ``C - ctx`` keys after them.

Capture needs what makes the step free of host synchronization: the
Triton prompt path (``Attention.prompt_ops``), the varlen kernel, no tensor
or pipeline parallelism and no MoE layers; without them (and on the CPU,
or with ``PDSERVE_PROMPT_GRAPHS=0``) prompts run eagerly as before. Without
capture ``run`` executes the same padded forward eagerly (attention per
segment), which is how the CPU tests cover this path."""
from __future__ import annotations

import logging
import os
import time

import torch

from ..attention import AttnMeta, varlen_kernel

log = logging.getLogger(__name__)
MAX_TOKENS = int(os.environ.get("PDSERVE_PROMPT_GRAPH_TOKENS", "1024"))
CACHED_MAX_TOKENS = 256  # chunks after a cached prefix: graphs up to this many tokens (a chat turn's new part)
MAX_CONTEXT = int(os.environ.get("PDSERVE_PROMPT_GRAPH_CONTEXT", "8192"))


def token_buckets(most: int) -> list[int]:
    """Sizes from 16 up to the first that holds ``most`` tokens, eight per doubling (16, 32, ..., 128, 144, 160,
    ..., 256, 288, ...): a prompt pads by at most an eighth plus one step."""
    out, size = [], 16
    while True:
        out.append(size)
        if size >= most:
            return out
        size += max(16, (1 << (size.bit_length() - 1)) // 8)


def context_buckets(most: int) -> list[int]:
    """512, 1024, 2048, ... up to the first that holds ``most`` positions (at most ``MAX_CONTEXT``)."""
    out, size = [], 512
    while most > 0 and size <= max(MAX_CONTEXT, 512):
        out.append(size)
        if size > most:
            break
        size *= 2
    return out


def supported(model, cfg) -> str | None:
    """Why prompt graphs cannot be captured for this engine (None: they can)."""
    if os.environ.get("PDSERVE_PROMPT_GRAPHS", "1") == "0" or MAX_TOKENS < 16:
        return "PDSERVE_PROMPT_GRAPHS=0"
    if cfg.tp > 1 or cfg.pp > 1:
        return "tensor or pipeline parallel"
    if model.spec.moe is not None or model.spec.qk_norm:
        return "MoE or q/k-norm layers"
    if any(layer.self_attn.prompt_ops is None for layer in model.owned_layers):
        return "no fused prompt path (PDSERVE_FUSED_PROMPT=0)"
    if next(model.parameters()).dtype not in (torch.float16, torch.bfloat16):
        return "the varlen kernel takes half precision"
    if varlen_kernel() is None:
        return "no varlen attention in this torch"
    return None


class PromptGraphs:
    def __init__(self, model, pool, device, most_tokens: int, capture: bool, mempool=None, most_context: int = 0):
        """``most_context``: the longest context (cached prefix + chunk) a chunk after a cached prefix may have to
        be replayed (0: fresh prompts only)."""
        self.model, self.pool, self.device, self.capture = model, pool, device, capture
        self.buckets = token_buckets(min(most_tokens, MAX_TOKENS))
        self.contexts = [c for c in context_buckets(most_context) if c % pool.block_size == 0]  # whole blocks
        top, keys, pinned = self.buckets[-1], max(self.contexts, default=0), device.type == "cuda"
        self.block_size = pool.block_size
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.table = torch.zeros(max(1, keys // self.block_size), dtype=torch.long, device=device)
        self.starts = torch.zeros(2, 3, dtype=torch.int32, device=device)  # queries [0, n, T], keys [0, ctx, C]
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # n - 1
        # two staging sets, alternated: a step is staged while the one before may still be copying from its own
        self.staged = [(torch.zeros(3, top, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(self.table.shape[0], dtype=torch.long, pin_memory=pinned),
                        torch.zeros(2, 3, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(1, dtype=torch.long, pin_memory=pinned)) for _ in range(2)]
        self.n = self.context = self.runs = self.replays = 0
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        if capture:
            with torch.cuda.device(device), torch.inference_mode():
                self._capture_all(mempool)

    def shapes(self) -> list[tuple[int, int]]:
        """(tokens, keys) of every graph: fresh prompts (keys 0), then chunks after a cached prefix."""
        return [(t, 0) for t in self.buckets] + [(t, c) for c in self.contexts for t in self.buckets
                                                  if t <= CACHED_MAX_TOKENS and t < c]

    def _forward(self, size: int, keys: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary, window = self.model.rotary, self.model.spec.sliding_window or 0
        n, ctx = self.n, self.context
        meta = AttnMeta(slots, [0, n, size], [ctx, size - n], False, rotary.cos[positions], rotary.sin[positions],
                        window=window)
        context = (self.table[:keys // self.block_size, None] * self.block_size
                   + torch.arange(self.block_size, device=self.device)).flatten() if keys else slots
        if self.capture and keys:
            meta.varlen_cached = (context, self.starts[0], self.starts[1], size, keys)
        elif self.capture:
            meta.varlen = (self.starts[0], size)
        else:  # the CPU form: each segment attends to itself, causally (the prompt within its window)
            meta.segments = [(context[:ctx], _causal_mask(n, ctx, window, self.device)) if keys or window else None,
                             None]
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last)).float()

    def _capture_all(self, mempool) -> None:
        begin = time.perf_counter()
        for size, keys in reversed(self.shapes()):
            self._stage([0] * (size - 1), 0, [-1] * (size - 1), [], size, keys)
            self._forward(size, keys)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[size, keys] = self._forward(size, keys)
            mempool = graph.pool()
            self.graphs[size, keys] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d prompt CUDA graphs (%s tokens; after cached prefixes up to %s keys) in %.1fs",
                 len(self.graphs), self.buckets, self.contexts[-1] if self.contexts else 0, time.perf_counter() - begin)

    def shape_for(self, n: int, start: int) -> tuple[int, int] | None:
        """The graph a chunk of ``n`` tokens from position ``start`` replays (None: none fits)."""
        size = next((t for t in self.buckets if t > n), None)
        if size is None or n < 1:
            return None
        if start == 0:
            return size, 0
        keys = next((c for c in self.contexts if c > start + n), None)
        return (size, keys) if keys is not None and size <= CACHED_MAX_TOKENS else None

    def _stage(self, ids: list[int], start: int, slots: list[int], table: list[int], size: int, keys: int) -> None:
        self.n = n = len(ids)
        self.context = ctx = start + n
        pad = size - n
        self.runs += 1
        tokens, blocks, starts, last = self.staged[self.runs % 2]
        tokens[:, :size] = torch.tensor([ids + [0] * pad, list(range(start, ctx)) + [0] * pad, slots + [-1] * pad])
        starts[:] = torch.tensor([[0, n, size], [0, ctx, keys]], dtype=torch.int32)
        last[0] = n - 1
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.starts.copy_(starts, non_blocking=True)
        self.last.copy_(last, non_blocking=True)
        if keys:  # the blocks holding the context; past it block 0 (read as the padding's keys, never the prompt's)
            width = keys // self.block_size
            blocks[:width] = torch.tensor(table[:width] + [0] * (width - min(len(table), width)))
            self.table[:width].copy_(blocks[:width], non_blocking=True)

    @torch.inference_mode()
    def run(self, ids: list[int], start: int, slots: list[int], table: list[int]) -> torch.Tensor:
        """The next-token logits ``[1, vocab]`` (fp32) of a chunk of ``len(ids)`` tokens from position ``start``
        (the ones before it in the pool) whose K/V go to ``slots``; ``table``: the sequence's blocks."""
        size, keys = self.shape_for(len(ids), start)
        if not self.capture:
            self._stage(ids, start, slots, table, size, keys)
            return self._forward(size, keys)
        with torch.cuda.device(self.device):
            self._stage(ids, start, slots, table, size, keys)
            self.graphs[size, keys].replay()
            self.replays += 1
            return self.outputs[size, keys]


def _causal_mask(n: int, ctx: int, window: int, device) -> torch.Tensor:
    """The last ``n`` of ``ctx`` positions attending to the ones before them (within ``window``)."""
    q, k = torch.arange(ctx - n, ctx, device=device), torch.arange(ctx, device=device)
    mask = k[None, :] <= q[:, None]
    return mask & (k[None, :] > q[:, None] - window) if window else mask
