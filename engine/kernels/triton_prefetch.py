"""A projection's weight pulled into L2 on a side stream while attention runs (CUDA, sm_80+; batches of few rows).

At batch 1 a decode layer reads its weights at the memory bandwidth in its
projections; between q/k/v and o runs attention (rotary + K/V store, the
split-K kernel, its merge): a few microseconds of small kernels that read
a few MB of K/V while memory sits nearly idle. o's weight (32 MB in bf16,
16 MB in FP8) fits the H100/H200's 50 MB L2 and is read only after. So
right after q/k/v the step forks onto a second stream (``start``): one
short kernel there pulls the weight into L2 while attention runs on the
step's stream, and o's launch waits for both (``join``). Inside a decode
CUDA graph the fork and the join are graph edges: the two branches run
concurrently. (Session 20 launched the same kernel on the step's own
stream: attention then waited for the fetches, batch 1 lost 7%.)

How the kernel pulls (``PDSERVE_PREFETCH``): ``bulk`` (sm_90) has each
thread issue one ``cp.async.bulk.prefetch.L2`` of a 16 KB chunk; ``line``
one ``prefetch.global.L2`` per 128-byte line; ``load`` reads the lines
(evict-last) and keeps nothing; ``0`` turns it off (the A/B).
``PDSERVE_PREFETCH_ROWS`` (4): the most rows a step may have to prefetch;
larger batches read K/V at the bandwidth during attention, leaving
nothing to overlap."""
from __future__ import annotations

import os

import torch

MODES = ("bulk", "line", "load")


def _mode() -> str | None:
    mode = os.environ.get("PDSERVE_PREFETCH", "bulk")
    if mode == "0" or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return None
    if mode not in MODES:
        raise ValueError(f"PDSERVE_PREFETCH={mode!r}: one of {', '.join(MODES)} or 0")
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return None
    return "line" if mode == "bulk" and major < 9 else mode


MODE = _mode()
ENABLED = MODE is not None
MAX_ROWS = int(os.environ.get("PDSERVE_PREFETCH_ROWS", "4"))
CHUNK = 16384  # bytes a bulk prefetch
LINE = 128
_SIDE: dict[int, torch.cuda.Stream] = {}
_SINK: dict[int, torch.Tensor] = {}

if ENABLED:
    import triton
    import triton.language as tl

    @triton.jit
    def _bulk(ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        chunk = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        at = ptr + chunk.to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - chunk.to(tl.int64) * CHUNK, CHUNK).to(tl.int32)
        size = tl.where(chunk.to(tl.int64) * CHUNK < nbytes, size, 0)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0;\n\t"
                                  "@p cp.async.bulk.prefetch.L2.global [$1], $2; }\n\tmov.u32 $0, 0;",
                                  "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _lines(ptr, nbytes, LINES: tl.constexpr):
        line = tl.program_id(0) * LINES + tl.arange(0, LINES)
        at = ptr + tl.minimum(line.to(tl.int64) * 128, nbytes - 1)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [at],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _loads(ptr, words, sink, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(ptr + i, mask=i < words, other=0, eviction_policy="evict_last")
        tl.store(sink, tl.sum(v, axis=0))  # a value no one reads: it keeps the loads


def takes(rows: int) -> bool:
    return ENABLED and rows <= MAX_ROWS


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (made on first use; call once outside graph capture)."""
    index = _index(device)
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
        _SINK[index] = torch.zeros(1, dtype=torch.int32, device=f"cuda:{index}")
    return _SIDE[index]


def l2(weight: torch.Tensor, mode: str | None = None) -> None:
    """Launch the kernel pulling ``weight`` (contiguous, CUDA) into L2 on the current stream."""
    mode = mode or MODE
    nbytes = weight.numel() * weight.element_size()
    flat = weight.view(-1).view(torch.uint8)
    if mode == "bulk":
        chunks = triton.cdiv(nbytes, CHUNK)
        _bulk[(triton.cdiv(chunks, 128),)](flat, nbytes, CHUNK=CHUNK, BLOCK=128, num_warps=4)
    elif mode == "line":
        lines = 2048
        _lines[(triton.cdiv(triton.cdiv(nbytes, LINE), lines),)](flat, nbytes, LINES=lines, num_warps=4)
    else:
        words = flat.view(torch.int32)
        side_stream(weight.device)
        _loads[(triton.cdiv(words.numel(), 4096),)](words, words.numel(), _SINK[_index(weight.device)],
                                                   BLOCK=4096, num_warps=8)


def start(weight: torch.Tensor) -> torch.cuda.Stream:
    """Fork: the side stream waits for the work issued so far, then pulls ``weight`` into L2 beside what the
    current stream runs next. Pass the result to ``join`` before the kernel that reads ``weight``."""
    side = side_stream(weight.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        l2(weight)
    return side


def join(side: torch.cuda.Stream) -> None:
    torch.cuda.current_stream().wait_stream(side)
