"""Weights pulled into the L2 cache while a batch-1 decode step waits on work that leaves the memory idle.

At batch 1 a decode step is the weights' bytes over the bandwidth plus
stretches where memory does nothing: a layer's attention (rotary + K/V store,
the split-K decode kernel and its combine, a few microseconds each over a
short context) and, under tensor parallelism, the two all-reduces (~10 us
each, latency over NVLink). The projection after each stretch then starts
reading its weights from memory cold. Here a second stream forks at the
stretch's start, reads the first ``PDSERVE_L2_PREFETCH_MB`` of the next
projection's weights (``.cg`` loads: kept in L2, not L1) and joins before
that projection, whose first tiles then come from L2:

* after q/k/v, during attention: o's weights;
* during the all-reduce after o (TP): gate/up's; after down: the next
  layer's q/k/v (the last layer's: the LM head's).

Inside a CUDA graph the fork and join are graph edges (the stream waits on
the capturing one first). Only one-row steps (the ``triton_gemv`` path) do
it; the L2 holds 50 MB (H100) to 60 MB (H200), and a stretch of 10-20 us
can fill 30-90 MB at 3.35-4.8 TB/s. Off by default (``0``): turned on per
run for the A/B (``bench/gpu_decode.sh prefetch``) until a GPU run shows it
pays. The loads are real reads whose sum is stored only when it equals a
value no weight sums to, so the compiler keeps them."""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
MB = int(os.environ.get("PDSERVE_L2_PREFETCH_MB", "0"))
WORDS = 4096  # int32 words (16 KiB) a program reads


@triton.jit
def _prefetch_kernel(src_ptr, sink_ptr, words, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * WORDS + tl.arange(0, WORDS)
    v = tl.load(src_ptr + offs, mask=offs < words, other=0, cache_modifier=".cg")  # L2 only, not L1
    total = tl.sum(v, axis=0)
    tl.store(sink_ptr + pid, total, mask=total == -2147483647)  # (almost) never: keeps the loads


class Prefetcher:
    """``fork(weight)`` reads the first ``nbytes`` of ``weight`` on a side stream; ``join()`` makes the current
    stream wait for it."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.nbytes = device, nbytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.sink = torch.zeros(max(1, nbytes // (4 * WORDS) + 1), dtype=torch.int32, device=device)
        self.forked = 0

    def words_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not weight.is_contiguous() or weight.numel() * weight.element_size() % 4:
            return None
        return weight.view(-1).view(torch.uint8).view(torch.int32)[:self.nbytes // 4]

    def fork(self, weight: torch.Tensor) -> None:
        words = self.words_of(weight)
        if words is None:
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._read(words)
        else:
            self._read(words)
        self.forked += 1

    def _read(self, words: torch.Tensor) -> None:
        n = words.numel()
        _prefetch_kernel[(triton.cdiv(n, WORDS),)](words, self.sink, n, WORDS=WORDS)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def reduces(linear) -> bool:
    """Whether ``linear`` all-reduces its output (row-parallel in a group of more than one rank)."""
    group = getattr(linear, "group", None)
    return group is not None and group.size > 1


def wire(model, device: torch.device, megabytes: int | None = None) -> Prefetcher | None:
    """Give each layer's attention and row-parallel projections of ``model`` what to prefetch (see the module
    docstring); None when off (``megabytes``, default ``PDSERVE_L2_PREFETCH_MB``, 0)."""
    megabytes = MB if megabytes is None else megabytes
    if megabytes <= 0:
        return None
    pf = Prefetcher(device, megabytes << 20)
    layers = list(model.owned_layers)
    head = getattr(model, "lm_head", None)
    for i, layer in enumerate(layers):
        attn, ffn = layer.self_attn, layer.ffn
        attn.l2 = pf
        gate_up = getattr(ffn, "gate_up_proj", None)
        if gate_up is not None and reduces(attn.o_proj):
            attn.o_proj.l2_next = (pf, gate_up.weight)
        after = layers[i + 1].self_attn.qkv_proj if i + 1 < len(layers) else head
        down = getattr(ffn, "down_proj", None)
        if after is not None and down is not None and reduces(down):
            down.l2_next = (pf, after.weight)
    log.info("L2 prefetch on: the first %d MiB of the next projection's weights during attention and all-reduces",
             megabytes)
    return pf
