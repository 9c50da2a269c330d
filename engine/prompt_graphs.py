"""A fresh prompt's first chunk run from a CUDA graph, not launch by launch.

An eager forward launches some 25 kernels a layer; for a prompt of a few
hundred tokens the host takes longer to launch them than the GPU to run
them (a 512-token prompt on an H200: 12 ms of GPU work, 22-40 ms of step
depending on the host). So the engine also captures the forward of one
prompt chunk of ``T`` tokens for ``T`` in ``token_buckets`` (eight sizes per
doubling from 16 up to ``PDSERVE_PROMPT_GRAPH_TOKENS``, default 1024: above
it a prompt keeps the GPU busy launched eagerly), and a step whose only row
is a prompt starting at position 0 (nothing of it cached), that samples and
wants no prompt logprobs, replays the smallest graph with more than its
``n`` tokens instead:

* ids, positions and KV slots go to static buffers; tokens ``n..T-1`` are
  padding with slot -1 (``rope_store`` writes nothing for them);
* attention is the varlen kernel over two packed sequences, the prompt
  ``[0, n)`` and the padding ``[n, T)`` (cumulative starts in a device
  buffer, the longest fixed at ``T``), so the padding never reaches the
  prompt's keys and the prompt's scores are those of a launch of ``n``;
* the logits are those of row ``n - 1`` only (an index buffer).

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

from .attention import AttnMeta, varlen_kernel

log = logging.getLogger(__name__)
MAX_TOKENS = int(os.environ.get("PDSERVE_PROMPT_GRAPH_TOKENS", "1024"))


def token_buckets(most: int) -> list[int]:
    """Sizes from 16 up to the first that holds ``most`` tokens, eight per doubling (16, 32, ..., 128, 144, 160,
    ..., 256, 288, ...): a prompt pads by at most an eighth plus one step."""
    out, size = [], 16
    while True:
        out.append(size)
        if size >= most:
            return out
        size += max(16, (1 << (size.bit_length() - 1)) // 8)


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
    def __init__(self, model, pool, device, most_tokens: int, capture: bool, mempool=None):
        self.model, self.pool, self.device, self.capture = model, pool, device, capture
        self.buckets = token_buckets(min(most_tokens, MAX_TOKENS))
        top, pinned = self.buckets[-1], device.type == "cuda"
        self.tokens = torch.zeros(3, top, dtype=torch.long, device=device)  # ids, positions, slots
        self.starts = torch.zeros(3, dtype=torch.int32, device=device)  # [0, n, T]
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # n - 1
        # two staging sets, alternated: a step is staged while the one before may still be copying from its own
        self.staged = [(torch.zeros(3, top, dtype=torch.long, pin_memory=pinned),
                        torch.zeros(3, dtype=torch.int32, pin_memory=pinned),
                        torch.zeros(1, dtype=torch.long, pin_memory=pinned)) for _ in range(2)]
        self.n = self.runs = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        if capture:
            with torch.cuda.device(device), torch.inference_mode():
                self._capture_all(mempool)

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slots = self.tokens[0, :size], self.tokens[1, :size], self.tokens[2, :size]
        rotary, window = self.model.rotary, self.model.spec.sliding_window or 0
        meta = AttnMeta(slots, [0, self.n, size], [self.n, size - self.n], False, rotary.cos[positions],
                        rotary.sin[positions], window=window)
        if self.capture:
            meta.varlen = (self.starts, size)
        else:  # the CPU form: each segment attends to itself, causally (the prompt within its window)
            meta.segments = [(slots[:self.n], _window_mask(self.n, window, slots.device)) if window else None, None]
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.model.logits(hidden.index_select(0, self.last)).float()

    def _capture_all(self, mempool) -> None:
        start = time.perf_counter()
        for size in reversed(self.buckets):
            self._stage([0] * (size - 1), [-1] * (size - 1), size)
            self._forward(size)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[size] = self._forward(size)
            mempool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured prompt CUDA graphs for %s tokens in %.1fs", self.buckets, time.perf_counter() - start)

    def takes(self, n: int) -> bool:
        return 0 < n < self.buckets[-1]

    def _stage(self, ids: list[int], slots: list[int], size: int) -> None:
        self.n = n = len(ids)
        pad = size - n
        self.runs += 1
        tokens, starts, last = self.staged[self.runs % 2]
        tokens[:, :size] = torch.tensor([ids + [0] * pad, list(range(n)) + [0] * pad, slots + [-1] * pad])
        starts[:] = torch.tensor([0, n, size], dtype=torch.int32)
        last[0] = n - 1
        self.tokens[:, :size].copy_(tokens[:, :size], non_blocking=True)
        self.starts.copy_(starts, non_blocking=True)
        self.last.copy_(last, non_blocking=True)

    @torch.inference_mode()
    def run(self, ids: list[int], slots: list[int]) -> torch.Tensor:
        """The next-token logits ``[1, vocab]`` (fp32) of a prompt of ``len(ids)`` tokens from position 0 whose
        K/V go to ``slots``."""
        size = next(s for s in self.buckets if s > len(ids))
        if not self.capture:
            self._stage(ids, slots, size)
            return self._forward(size)
        with torch.cuda.device(self.device):
            self._stage(ids, slots, size)
            self.graphs[size].replay()
            self.replays += 1
            return self.outputs[size]


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
