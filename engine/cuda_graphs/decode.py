"""Decode steps with fixed shapes, captured as CUDA graphs.

A decode-only batch of ``n`` sequences is padded to the next captured size
(1, 2, 4, 8, then multiples of 16 up to the engine's ``max_num_seqs``): the
token ids, positions and slots (-1 for padding rows: nothing is written),
block tables and context lengths are copied into static buffers, and the
graph captured for that size replays the whole forward (embedding, every
layer with ``paged`` attention over the pool, the final norm and the logits)
with one launch. Nothing inside waits on the host; the caller reads the
logits of the ``n`` real rows. Larger batches run the same code eagerly.
Without capture (CPU, or ``cuda_graphs=False``) ``run`` executes the same
padded forward eagerly, which is how the CPU tests cover this path."""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..attention import AttnMeta
from .replay_timer import ReplayTimer

log = logging.getLogger(__name__)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, up to the first size that holds ``max_batch``."""
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= max_batch:
            return sizes
        size = size * 2 if size < 16 else size + 16


class DecodeGraphs:
    def __init__(self, model, pool, device, max_batch: int, max_blocks: int, ops, capture: bool,
                 part: str | None = None):
        """``ops``: ``kernels.paged`` or ``kernels.triton_attention``. ``part``: a pipeline stage's share of the
        step (``engine.pipeline``): ``first`` (token ids through the embedding and the stage's layers) or ``rest``
        (the residual stream of the stage before, in ``hidden``, through the stage's layers); either returns the
        residual stream after them, which the hop carries on (stage 0 applies the final norm and the logits)."""
        self.model, self.pool, self.device, self.ops, self.part = model, pool, device, ops, part
        self.sizes = batch_sizes(max_batch)
        top = self.sizes[-1]
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.feed_rows = torch.zeros(top, dtype=torch.long, device=device)
        if part == "rest":
            dtype = next(model.parameters()).dtype
            self.hidden = torch.zeros(top, model.spec.hidden_size, dtype=dtype, device=device)
        # two staging buffers, alternated: a step is prepared while the one before may still be copying from its own
        self.staging = [torch.zeros(4, top, dtype=torch.long, pin_memory=device.type == "cuda") for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.runs = self.replays = 0
        self.timer: ReplayTimer | None = None  # device time of each replay (``replay_timer``), once captured
        self.mempool = None  # the captures' memory pool (``prompt`` captures into it too)
        self.prompts = None  # ``prompt.PromptGraphs``: fresh prompts' first chunks, where captured
        self.mixed = None  # ``mixed.MixedGraphs``: decode rows with prompt chunks, where captured
        if capture:
            self._capture()

    def _forward(self, n: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :n], self.tokens[1, :n], self.tokens[2, :n]
        rotary = self.model.rotary
        meta = AttnMeta(slots, [], [], True, rotary.cos[positions], rotary.sin[positions], paged=self.ops,
                        tables=self.tables[:n], lens=self.lens[:n], window=self.model.spec.sliding_window or 0)
        if self.part is not None:
            return self.model.stage_forward(self.hidden[:n] if self.part == "rest" else ids, positions, meta,
                                            self.pool.layers)
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden).float()

    def _on_device(self):
        """Triton launches and graph replays go to the current CUDA device: make it this engine's (cuda:1 too)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def _capture(self) -> None:
        with self._on_device():
            self._capture_all()

    def _capture_all(self) -> None:
        start, mempool = time.perf_counter(), None
        for n in reversed(self.sizes):
            self._forward(n)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[n] = self._forward(n)
            mempool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        self.mempool = mempool
        self.timer = ReplayTimer()
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.sizes, time.perf_counter() - start)

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int], feed: tuple | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits ``[n, vocab]`` (fp32) of ``n <= sizes[-1]`` decode rows (a pipeline stage: the residual
        stream after its layers; ``x``: the stage before's, ``rest``). ``feed``: ``(device tokens, [row of them or
        -1 per row])``: those rows' input ids come from the device tokens (``engine.overlap``)."""
        with self._on_device():
            if x is not None:
                self.hidden[:len(ids)].copy_(x)
            return self._run(ids, positions, slots, tables, lens, feed)

    def _run(self, ids, positions, slots, tables, lens, feed=None) -> torch.Tensor:
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        self.runs += 1
        width = max(len(t) for t in tables)
        pad = [-1] * (size - n)
        staged = self.staging[self.runs % 2][:, :size]
        fed = feed[1] + pad if feed is not None else pad + [-1] * n
        staged.copy_(torch.tensor([ids + [0] * (size - n), positions + [0] * (size - n), slots + pad, fed]))
        rows = torch.tensor([t + [0] * (width - len(t)) + [n_] for t, n_ in zip(tables, lens)]
                            + [[0] * (width + 1)] * (size - n), dtype=torch.int32).to(self.device, non_blocking=True)
        self.tokens[:, :size].copy_(staged[:3], non_blocking=True)
        if feed is not None:
            src = self.feed_rows[:size]
            src.copy_(staged[3], non_blocking=True)
            held = feed[0][src.clamp(min=0)]
            self.tokens[0, :size] = torch.where(src >= 0, held, self.tokens[0, :size])
        self.tables[:size, :width].copy_(rows[:, :width])
        self.lens[:size].copy_(rows[:, width])
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        timing = self.timer.start() if self.timer is not None else None
        graph.replay()
        if timing is not None:
            self.timer.stop(timing)
        self.replays += 1
        return self.outputs[size][:n]
