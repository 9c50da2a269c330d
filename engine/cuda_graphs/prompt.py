"""Prompt chunks run from a CUDA graph, not launch by launch.

An eager forward launches some 25 kernels a layer; for a prompt of a few
hundred tokens the host takes longer to launch them than the GPU to run
them (a 512-token prompt on an H200: 12 ms of GPU work, 22-40 ms of step
depending on the host), and a prefill worker under load packs a few such
prompts a step (1P1D at 32 streams: ~3 of 512 tokens, 30 us a token
where the engine alone reaches 25). So the engine also captures the
forward of ``T`` prompt tokens for ``T`` in ``token_buckets`` (eight sizes
per doubling from 16 up to ``MAX_TOKENS``, 1024),
and a step whose rows are all prompt chunks (at most
``ROWS`` of them, 8, wanting no prompt
logprobs) replays the smallest graph that holds their ``E`` tokens and
``ROWS - K`` tokens more. Fresh chunks (from position 0):

* ids, positions and KV slots go to static buffers; tokens from ``E`` on are
  padding with slot -1 (``rope_store`` writes nothing for them);
* attention is the varlen kernel over ``ROWS + 1`` packed sequences (their
  cumulative starts in a device buffer, the longest fixed at ``T``): the
  ``K`` prompts, ``ROWS - K`` padding sequences of one token and the rest
  of the padding, so no sequence is empty, the padding never reaches a
  prompt's keys and each prompt's scores are those of an eager launch;
* the logits are those of each prompt's last row (an index buffer of
  ``ROWS``; the padding sequences' rows are read and dropped).

Where a chunk follows a cached prefix (a chat turn whose history is in the
pool; up to ``CACHED_MAX_TOKENS`` new tokens in all) the step replays a
graph per (token bucket, context bucket ``C``: 512, 1024, ... up to
``MAX_CONTEXT``, 8192, holding the chunks' contexts and
one key per padding sequence more): each sequence's keys are gathered from
the pool through its block table (``ROWS + 1`` tables in a static buffer,
the keys' cumulative starts beside the queries'; the device finds each key
position's sequence with ``searchsorted``; the padding's keys come from
block 0) and attend as in the eager step (``attention.varlen_cached``,
causal from the bottom right). Fresh chunks in such a step are chunks whose
context is themselves.

Capture needs what makes the step free of host synchronization: the
Triton prompt path (``Attention.prompt_ops``), the varlen kernel, no tensor
or pipeline parallelism and no MoE layers; without them (and on the CPU)
prompts run eagerly as before. Without
capture ``run`` executes the same padded forward eagerly (attention per
segment), which is how the CPU tests cover this path."""
from __future__ import annotations

import logging
import time

import torch

from ..attention import AttnMeta, varlen_kernel

log = logging.getLogger(__name__)
MAX_TOKENS = 1024
CACHED_MAX_TOKENS = 256  # chunks after a cached prefix: graphs up to this many tokens (a chat turn's new part)
MAX_CONTEXT = 8192
ROWS = 8  # fresh prompts one replay takes


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
    if MAX_TOKENS < 16:
        return "no token bucket"
    if cfg.tp > 1 or cfg.pp > 1:
        return "tensor or pipeline parallel"
    if model.spec.moe is not None or model.spec.qk_norm:
        return "MoE or q/k-norm layers"
    if any(layer.self_attn.prompt_ops is None for layer in model.owned_layers):
        return "no fused prompt path"
    if next(model.parameters()).dtype not in (torch.float16, torch.bfloat16):
        return "the varlen kernel takes half precision"
    if varlen_kernel() is None:
        return "no varlen attention in this torch"
    return None


class PromptGraphs:
    def __init__(self, model, pool, device, most_tokens: int, capture: bool, mempool=None, most_context: int = 0):
        """``most_context``: the longest context (cached prefixes + chunks) chunks after cached prefixes may have to
        be replayed with (0: fresh prompts only)."""
        self.model, self.pool, self.device, self.capture = model, pool, device, capture
        self.varlen = capture  # attention through the varlen kernel and the device buffers (else the CPU form)
        self.buckets = token_buckets(min(most_tokens, MAX_TOKENS))
        self.contexts = [c for c in context_buckets(most_context) if c % pool.block_size == 0]  # whole blocks
        top, keys, pinned = self.buckets[-1], max(self.contexts, default=0), device.type == "cuda"
        self.block_size = pool.block_size
        width = max(1, keys // self.block_size)
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.tables = torch.zeros(ROWS + 1, width, dtype=torch.long, device=device)  # each sequence's blocks
        self.starts = torch.zeros(2, ROWS + 2, dtype=torch.int32, device=device)  # queries', keys' cumulative starts
        self.last = torch.zeros(ROWS, dtype=torch.long, device=device)  # each prompt's last row
        self.key_positions = torch.arange(max(1, keys), device=device)
        # two staging sets, alternated: a step is staged while the one before may still be copying from its own
        self.staged = [(torch.zeros(3, top, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(ROWS + 1, width, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(2, ROWS + 2, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(ROWS, dtype=torch.long, pin_memory=pinned)) for _ in range(2)]
        self.runs = self.replays = self.rows = 0
        self.layout: list[list[int]] = [[], []]  # the starts on the host (the CPU form's segments)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        if capture:
            with torch.cuda.device(device), torch.inference_mode():
                self._capture_all(mempool)

    def shapes(self) -> list[tuple[int, int]]:
        """(tokens, keys) of every graph: fresh prompts (keys 0), then chunks after cached prefixes."""
        return [(t, 0) for t in self.buckets if t > ROWS] + [(t, c) for c in self.contexts for t in self.buckets
                                                             if ROWS < t <= CACHED_MAX_TOKENS and t < c]

    def _context(self, keys: int) -> torch.Tensor:
        """The pool slots of the ``keys`` key positions: each sequence's context read through its block table (the
        padding sequences' from block 0), as the device computes it from ``tables`` and the keys' starts."""
        pos, starts = self.key_positions[:keys], self.starts[1].long()
        row = torch.searchsorted(starts[1:], pos, right=True)
        offset = pos - starts[row]
        return self.tables[row, torch.div(offset, self.block_size, rounding_mode="floor")] * self.block_size \
            + offset % self.block_size

    def _forward(self, size: int, keys: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary, window = self.model.rotary, self.model.spec.sliding_window or 0
        queries, contexts = self.layout
        lens = [e - s for s, e in zip(contexts, contexts[1:])]  # fresh chunks: their own tokens
        meta = AttnMeta(slots, queries, lens, False, rotary.cos[positions], rotary.sin[positions], window=window)
        context = self._context(keys) if keys else slots
        if self.varlen and keys:
            meta.varlen_cached = (context, self.starts[0], self.starts[1], size, keys)
        elif self.varlen:
            meta.varlen = (self.starts[0], size)
        else:  # the CPU form: each sequence attends to its context causally (a prompt within its window)
            spans = zip(queries, queries[1:], contexts, contexts[1:])
            meta.segments = [(context[ks:ke], _causal_mask(e - s, ke - ks, window, self.device))
                             if i < self.rows and (keys or window) else None  # the padding: to itself
                             for i, (s, e, ks, ke) in enumerate(spans)]
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last)).float()

    def _capture_all(self, mempool) -> None:
        begin = time.perf_counter()
        for size, keys in reversed(self.shapes()):
            n = size - ROWS
            self._stage([[0] * n], [0], [[-1] * n], [[]], size, keys)
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

    def shape_for(self, lens: list[int], starts: list[int]) -> tuple[int, int] | None:
        """The graph (tokens, keys) that chunks of ``lens`` tokens from positions ``starts`` replay together (None:
        none fits): their tokens and keys (fresh prompts: keys 0), and one of each for every padding sequence and at
        least one more."""
        if not lens or len(lens) > ROWS or min(lens) < 1:
            return None
        pads = ROWS - len(lens)
        size = next((t for t in self.buckets if t > sum(lens) + pads), None)
        if size is None or not any(starts):
            return None if size is None else (size, 0)
        keys = next((c for c in self.contexts if c > sum(starts) + sum(lens) + pads), None)
        return (size, keys) if keys is not None and size <= CACHED_MAX_TOKENS else None

    def _stage(self, ids: list[list[int]], starts: list[int], slots: list[list[int]], tables: list[list[int]],
               size: int, keys: int) -> None:
        """The chunks packed from row 0, then ``ROWS - K`` one-token padding sequences and the rest of ``size``
        (of ``keys`` too, after the chunks' contexts)."""
        lens, pads = [len(x) for x in ids], ROWS - len(ids)
        used, self.rows = sum(lens), len(ids)
        self.runs += 1
        tokens, blocks, cumulative, last = self.staged[self.runs % 2]
        fill = size - used
        tokens[:, :size] = torch.tensor([[t for x in ids for t in x] + [0] * fill,
                                         [p for n, a in zip(lens, starts) for p in range(a, a + n)] + [0] * fill,
                                         [s for x in slots for s in x] + [-1] * fill])
        queries = _cumulative(lens, pads, size)
        contexts = _cumulative([a + n for a, n in zip(starts, lens)], pads, keys) if keys else queries
        self.layout = [queries, contexts]
        cumulative[:] = torch.tensor([queries, contexts], dtype=torch.int32)
        last[:] = torch.tensor([e - 1 for e in queries[1:len(lens) + 1]] + [0] * pads)
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.starts.copy_(cumulative, non_blocking=True)
        self.last.copy_(last, non_blocking=True)
        if keys:  # the blocks holding each context; the padding sequences' (and past a context) block 0
            width = keys // self.block_size
            blocks[:, :width] = 0
            for i, (table, a, n) in enumerate(zip(tables, starts, lens)):
                held = min(len(table), width, -(-(a + n) // self.block_size))
                blocks[i, :held] = torch.tensor(table[:held], dtype=torch.long)
            self.tables[:, :width].copy_(blocks[:, :width], non_blocking=True)

    @torch.inference_mode()
    def run(self, ids: list[list[int]], starts: list[int], slots: list[list[int]], tables: list[list[int]]):
        """The next-token logits ``[ROWS, vocab]`` (fp32; the first ``len(ids)`` rows are the chunks') of prompt
        chunks from positions ``starts`` (the tokens before them in the pool, held by the blocks of ``tables``)
        whose K/V go to ``slots``."""
        size, keys = self.shape_for([len(x) for x in ids], starts)
        if not self.capture:
            self._stage(ids, starts, slots, tables, size, keys)
            return self._forward(size, keys)
        with torch.cuda.device(self.device):
            self._stage(ids, starts, slots, tables, size, keys)
            self.graphs[size, keys].replay()
            self.replays += 1
            return self.outputs[size, keys]


def _cumulative(lens: list[int], pads: int, total: int) -> list[int]:
    """Cumulative starts of sequences of ``lens``, ``pads`` one-long ones after them and the rest of ``total``."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out + [out[-1] + i + 1 for i in range(pads)] + [total]


def _causal_mask(n: int, ctx: int, window: int, device) -> torch.Tensor:
    """The last ``n`` of ``ctx`` positions attending to the ones before them (within ``window``)."""
    q, k = torch.arange(ctx - n, ctx, device=device), torch.arange(ctx, device=device)
    mask = k[None, :] <= q[:, None]
    return mask & (k[None, :] > q[:, None] - window) if window else mask
