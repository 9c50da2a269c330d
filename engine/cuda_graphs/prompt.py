"""Prompt chunks run from a CUDA graph, not launch by launch.

An eager forward launches some 25 kernels a layer; for a prompt of a few
hundred tokens the host takes longer to launch them than the GPU to run
them (a 512-token prompt on an H200: 12 ms of GPU work, 22-40 ms of step
depending on the host), and a prefill worker under load packs a few such
prompts a step (1P1D at 32 streams: ~3 of 512 tokens, 30 us a token
where the engine alone reaches 25). So the engine also captures the
forward of ``T`` prompt tokens for ``T`` in ``token_buckets`` (eight sizes
per doubling from 16 up to ``PDSERVE_PROMPT_GRAPH_TOKENS``, default 1024),
and a step whose rows are all fresh prompt chunks (from position 0, at
most ``PDSERVE_PROMPT_GRAPH_ROWS`` of them, default 8, wanting no prompt
logprobs) replays the smallest graph that holds their ``E`` tokens and
``ROWS - K`` tokens more:

* ids, positions and KV slots go to static buffers; tokens from ``E`` on are
  padding with slot -1 (``rope_store`` writes nothing for them);
* attention is the varlen kernel over ``ROWS + 1`` packed sequences (their
  cumulative starts in a device buffer, the longest fixed at ``T``): the
  ``K`` prompts, ``ROWS - K`` padding sequences of one token and the rest
  of the padding, so no sequence is empty, the padding never reaches a
  prompt's keys and each prompt's scores are those of an eager launch;
* the logits are those of each prompt's last row (an index buffer of
  ``ROWS``; the padding sequences' rows are read and dropped).

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
ROWS = max(1, int(os.environ.get("PDSERVE_PROMPT_GRAPH_ROWS", "8")))  # fresh prompts one replay takes (1: one alone)


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
        self.varlen = capture  # attention through the varlen kernel and the device buffers (else the CPU form)
        self.buckets = token_buckets(min(most_tokens, MAX_TOKENS))
        self.contexts = [c for c in context_buckets(most_context) if c % pool.block_size == 0]  # whole blocks
        top, keys, pinned = self.buckets[-1], max(self.contexts, default=0), device.type == "cuda"
        self.block_size = pool.block_size
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.table = torch.zeros(max(1, keys // self.block_size), dtype=torch.long, device=device)
        self.starts = torch.zeros(2, 3, dtype=torch.int32, device=device)  # queries [0, n, T], keys [0, ctx, C]
        self.packed = torch.zeros(ROWS + 2, dtype=torch.int32, device=device)  # fresh prompts' query starts
        self.last = torch.zeros(ROWS, dtype=torch.long, device=device)  # each prompt's last row (cached: one)
        # two staging sets, alternated: a step is staged while the one before may still be copying from its own
        self.staged = [(torch.zeros(3, top, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(self.table.shape[0], dtype=torch.long, pin_memory=pinned),
                        torch.zeros(2, 3, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(ROWS, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(ROWS + 2, dtype=torch.int32, pin_memory=pinned)) for _ in range(2)]
        self.n = self.context = self.runs = self.replays = 0
        self.layout: list[int] = []  # the fresh prompts' query starts on the host (the CPU form's segments)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        if capture:
            with torch.cuda.device(device), torch.inference_mode():
                self._capture_all(mempool)

    def shapes(self) -> list[tuple[int, int]]:
        """(tokens, keys) of every graph: fresh prompts (keys 0), then chunks after a cached prefix."""
        return [(t, 0) for t in self.buckets if t > ROWS] + [(t, c) for c in self.contexts for t in self.buckets
                                                             if t <= CACHED_MAX_TOKENS and t < c]

    def _forward(self, size: int, keys: int) -> torch.Tensor:
        if not keys:
            return self._forward_fresh(size)
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary, window = self.model.rotary, self.model.spec.sliding_window or 0
        n, ctx = self.n, self.context
        meta = AttnMeta(slots, [0, n, size], [ctx, size - n], False, rotary.cos[positions], rotary.sin[positions],
                        window=window)
        context = (self.table[:keys // self.block_size, None] * self.block_size
                   + torch.arange(self.block_size, device=self.device)).flatten()
        if self.varlen:
            meta.varlen_cached = (context, self.starts[0], self.starts[1], size, keys)
        else:  # the CPU form: the chunk attends to its context, the padding to itself
            meta.segments = [(context[:ctx], _causal_mask(n, ctx, window, self.device)), None]
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last[:1])).float()

    def _forward_fresh(self, size: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary, window = self.model.rotary, self.model.spec.sliding_window or 0
        starts = self.layout
        meta = AttnMeta(slots, starts, [e - s for s, e in zip(starts, starts[1:])], False, rotary.cos[positions],
                        rotary.sin[positions], window=window)
        if self.varlen:
            meta.varlen = (self.packed, size)
        else:  # the CPU form: each sequence attends to itself, causally (a prompt within its window)
            meta.segments = [(slots[s:e], _causal_mask(e - s, e - s, window, self.device)) if window else None
                             for s, e in zip(starts, starts[1:])]
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last)).float()

    def _capture_all(self, mempool) -> None:
        begin = time.perf_counter()
        for size, keys in reversed(self.shapes()):
            if keys:
                self._stage([0] * (size - 1), 0, [-1] * (size - 1), [], size, keys)
            else:
                self._stage_fresh([[0] * (size - ROWS)], [[-1] * (size - ROWS)], size)
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
        if start == 0:
            size = self.fresh_size([n])
            return None if size is None else (size, 0)
        size = next((t for t in self.buckets if t > n), None)
        if size is None or n < 1:
            return None
        keys = next((c for c in self.contexts if c > start + n), None)
        return (size, keys) if keys is not None and size <= CACHED_MAX_TOKENS else None

    def fresh_size(self, lens: list[int]) -> int | None:
        """The tokens of the graph that fresh prompt chunks of ``lens`` tokens replay together (None: none): theirs
        and one for each padding sequence, and at least one more."""
        if not lens or len(lens) > ROWS or min(lens) < 1:
            return None
        need = sum(lens) + ROWS - len(lens)
        return next((t for t in self.buckets if t > need), None)

    def _stage(self, ids: list[int], start: int, slots: list[int], table: list[int], size: int, keys: int) -> None:
        self.n = n = len(ids)
        self.context = ctx = start + n
        pad = size - n
        self.runs += 1
        tokens, blocks, starts, last, _ = self.staged[self.runs % 2]
        tokens[:, :size] = torch.tensor([ids + [0] * pad, list(range(start, ctx)) + [0] * pad, slots + [-1] * pad])
        starts[:] = torch.tensor([[0, n, size], [0, ctx, keys]], dtype=torch.int32)
        last[0] = n - 1
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.starts.copy_(starts, non_blocking=True)
        self.last[:1].copy_(last[:1], non_blocking=True)
        if keys:  # the blocks holding the context; past it block 0 (read as the padding's keys, never the prompt's)
            width = keys // self.block_size
            blocks[:width] = torch.tensor(table[:width] + [0] * (width - min(len(table), width)))
            self.table[:width].copy_(blocks[:width], non_blocking=True)

    def _stage_fresh(self, ids: list[list[int]], slots: list[list[int]], size: int) -> None:
        """Fresh prompts packed from row 0, then ``ROWS - K`` one-token padding sequences and the rest of ``size``."""
        lens = [len(x) for x in ids]
        used, pads = sum(lens), ROWS - len(lens)
        self.runs += 1
        tokens, _, _, last, packed = self.staged[self.runs % 2]
        fill = size - used
        tokens[:, :size] = torch.tensor([[t for x in ids for t in x] + [0] * fill,
                                         [p for n in lens for p in range(n)] + [0] * fill,
                                         [s for x in slots for s in x] + [-1] * fill])
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        self.layout = starts = starts + [used + i + 1 for i in range(pads)] + [size]
        packed[:] = torch.tensor(starts, dtype=torch.int32)
        last[:] = torch.tensor([e - 1 for e in starts[1:len(lens) + 1]] + [0] * pads)
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.packed.copy_(packed, non_blocking=True)
        self.last.copy_(last, non_blocking=True)

    @torch.inference_mode()
    def run_fresh(self, ids: list[list[int]], slots: list[list[int]]) -> torch.Tensor:
        """The next-token logits ``[ROWS, vocab]`` (fp32; the first ``len(ids)`` rows are the prompts') of fresh
        prompt chunks (from position 0) whose K/V go to ``slots``."""
        size = self.fresh_size([len(x) for x in ids])
        if not self.capture:
            self._stage_fresh(ids, slots, size)
            return self._forward_fresh(size)
        with torch.cuda.device(self.device):
            self._stage_fresh(ids, slots, size)
            self.graphs[size, 0].replay()
            self.replays += 1
            return self.outputs[size, 0]

    @torch.inference_mode()
    def run(self, ids: list[int], start: int, slots: list[int], table: list[int]) -> torch.Tensor:
        """The next-token logits ``[1, vocab]`` (fp32) of a chunk of ``len(ids)`` tokens from position ``start``
        (the ones before it in the pool) whose K/V go to ``slots``; ``table``: the sequence's blocks."""
        if start == 0:
            return self.run_fresh([ids], [slots])[:1]
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
