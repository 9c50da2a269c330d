"""Mixed steps (decode rows and prompt chunks together) replayed from CUDA graphs.

A step that decodes ``R`` sequences and takes a prompt chunk beside them should read the weights once and launch
nothing of its own: one forward over all its tokens, captured. Only the token count picks the graph: for ``T`` in
``buckets`` (eight sizes per doubling from 16 up to the engine's step budget, at most ``MAX_TOKENS``) the engine
captures the whole forward of ``T`` rows (embedding, every layer, the final norm, the logits of the rows named by
an index buffer), whose attention is ``kernels.triton_mixed``: one launch for any mix of decode rows and chunks
(fresh or after a cached prefix, of any context length), its grid fixed by ``T`` and the most sequences a step
holds, what it attends read from device buffers:

* ids, positions and KV slots of the step's tokens in ``tokens`` (rows from the step's ``n`` on are padding: slot
  -1, ``rope_store`` writes nothing for them, no tile names them, the logits never read them);
* each sequence's block table in ``tables``;
* the tiles (sequence, first row, tokens, first position, key range, scratch slot) in ``tiles``, and the merges of
  split tiles (``triton_mixed.cut``: a tile over a long context is split over its keys) in ``merges``; unused
  entries say -1;
* the rows that sample (each sequence's last token) in ``last``.

A step of ``n`` tokens replays the smallest bucket that holds them. The graphs share the decode graphs' memory pool.
Capture needs what prompt graphs need (``prompt.supported``); steps with prompt logprobs or past the top bucket run
eagerly. Without capture (the CPU tests) ``run`` executes the same padded forward (the kernel in Triton's
interpreter)."""
from __future__ import annotations

import logging
import time

import torch

from ..attention import AttnMeta
from .prompt import token_buckets

log = logging.getLogger(__name__)
MAX_TOKENS = 1024  # beyond it a step's forward is long enough to launch eagerly


class MixedGraphs:
    def __init__(self, model, pool, device, most_tokens: int, most_seqs: int, max_blocks: int, capture: bool,
                 kernels=None, rope=None, mempool=None):
        """``kernels``: ``triton_mixed``; ``rope``: the module whose ``rope_store`` rotates and stores K/V
        (``triton_attention``; ``paged`` in tests)."""
        from ..kernels import triton_attention, triton_mixed

        self.model, self.pool, self.device, self.capture = model, pool, device, capture
        self.kernels, self.rope = kernels or triton_mixed, rope or triton_attention
        self.buckets = token_buckets(max(16, min(most_tokens, MAX_TOKENS)))
        top = self.buckets[-1]
        attn = model.owned_layers[0].self_attn
        self.per_tile = self.kernels.block_q(attn.heads, attn.kv_heads)
        self.most_seqs = min(most_seqs, top)
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.tables = torch.zeros(self.most_seqs, max_blocks, dtype=torch.int32, device=device)
        self.tiles = torch.zeros(self._tiles(top), 8, dtype=torch.int32, device=device)
        self.merges = torch.zeros(self.kernels.most_merges(), 4, dtype=torch.int32, device=device)
        self.last = torch.zeros(self.most_seqs, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.staged = [(torch.zeros(3, top, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(self.most_seqs, max_blocks, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(self._tiles(top), 8, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(self.most_seqs, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(self.kernels.most_merges(), 4, dtype=torch.int32, pin_memory=pinned))
                       for _ in range(2)]
        self.window = model.spec.sliding_window or 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.runs = self.replays = 0
        if capture:
            with torch.cuda.device(device), torch.inference_mode():
                self._capture_all(mempool)

    def _tiles(self, size: int) -> int:
        return self.kernels.most_tiles(size, self.most_seqs, self.per_tile)

    def fits(self, tokens: int, seqs: int) -> bool:
        return tokens <= self.buckets[-1] and seqs <= self.most_seqs

    def attend(self, module, qkv: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """Called by ``Attention.forward`` (``meta.mixed_graph``): rotary, the K/V store and attention of the bucket's
        rows, ``[T, heads * dim]``."""
        size = qkv.shape[0]
        q = self.rope.rope_store(qkv, self.cos, self.sin, k_cache, v_cache, self.tokens[2, :size], module.heads,
                                 module.kv_heads, module.kv_scales)
        out = self.kernels.attend(q, k_cache, v_cache, self.tables, self.tiles[:self._tiles(size)], module.scale,
                                  self.window, module.kv_scales, merges=self.merges)
        return out.reshape(size, -1)

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary = self.model.rotary
        self.cos, self.sin = rotary.cos[positions], rotary.sin[positions]
        meta = AttnMeta(slots, [], [], False, mixed_graph=self)
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last[:min(size, self.most_seqs)])).float()

    def _capture_all(self, mempool) -> None:
        begin = time.perf_counter()
        for size in reversed(self.buckets):
            self._forward(size)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[size] = self._forward(size)
            mempool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured mixed-step CUDA graphs for %s tokens in %.1fs", self.buckets, time.perf_counter() - begin)

    def _stage(self, ids, positions, slots, tables, query_starts, starts, size) -> int:
        """The step's buffers (host lists) staged and copied to the device; the number of rows that sample."""
        self.runs += 1
        tokens, blocks, tiles, last, merges = self.staged[self.runs % 2]
        fill = size - len(ids)
        tokens[:, :size] = torch.tensor([ids + [0] * fill, positions + [0] * fill, slots + [-1] * fill])
        cut, merged = self.kernels.cut(query_starts, starts, self.per_tile, self.window)
        count = self._tiles(size)
        tiles[:count] = torch.tensor(cut + [self.kernels.NO_TILE] * (count - len(cut)), dtype=torch.int32)
        merges[:] = torch.tensor(merged + [self.kernels.NO_MERGE] * (len(merges) - len(merged)), dtype=torch.int32)
        width = max(len(t) for t in tables)
        blocks[:len(tables), :width] = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        rows = min(size, self.most_seqs)  # every index the bucket's logits read: the unused ones row 0, in range
        last[:rows] = torch.tensor([e - 1 for e in query_starts[1:]] + [0] * (rows - len(tables)))
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.tiles[:count].copy_(tiles[:count], non_blocking=True)
        self.merges.copy_(merges, non_blocking=True)
        self.tables[:len(tables), :width].copy_(blocks[:len(tables), :width], non_blocking=True)
        self.last[:rows].copy_(last[:rows], non_blocking=True)
        return len(tables)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            query_starts: list[int], starts: list[int]) -> torch.Tensor:
        """Next-token logits ``[sequences, vocab]`` (fp32) of every sequence's last token, for sequences packed at
        ``query_starts`` whose new tokens start at positions ``starts`` (their blocks in ``tables``)."""
        size = next(t for t in self.buckets if t >= len(ids))
        if not self.capture:
            seqs = self._stage(ids, positions, slots, tables, query_starts, starts, size)
            return self._forward(size)[:seqs]
        with torch.cuda.device(self.device):
            seqs = self._stage(ids, positions, slots, tables, query_starts, starts, size)
            self.graphs[size].replay()
            self.replays += 1
            return self.outputs[size][:seqs]
