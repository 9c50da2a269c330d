"""Attention over the paged KV pool.

The pool holds, per layer, ``k_cache``/``v_cache`` shaped ``[num_blocks,
block_size, kv_heads, head_dim]``. A batch is the new tokens of several
sequences packed one after another. ``AttnMeta`` is built once per step
(``build_meta``): the flat slot (``block * block_size + offset``) of every
new token, the rotary tables of their positions, and how each sequence
attends: decode-only batches gather every sequence's context slots into one
padded ``[batch, context]`` index with a validity mask and attend with two
grouped matmuls (no K/V repeat for GQA); sequences with prompt chunks attend
one by one with SDPA, causal, offset by any cached prefix (on CUDA a chunk after a prefix attends to the prefix
and to itself in two cuDNN calls merged by their log-sum-exps: ``kernels.prefix_split``; a batch
of three or more fresh prompts goes to FlashAttention's varlen kernel in one
call instead: ``varlen``; chunks after cached prefixes too, their whole
context's keys gathered from the pool first: ``varlen_cached``). A mixed step (``mixed``) puts its one-token
decode rows first and attends them with the decode graphs' kernels, the
prompt chunks after them as above, in one forward. Each layer first
writes the new K/V into their slots. This is the portable backend (CPU, and
correct on CUDA). A meta with ``paged`` set (decode steps of ``graphs``)
goes to those fixed-shape operations instead: ``paged`` in torch,
``kernels.triton_attention`` as CUDA kernels."""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kernels import prefix_split
from .quant import kv_fp8

log = logging.getLogger(__name__)

FORCE_DECODE: str | None = None  # "sdpa" | "matmul": the decode kernel on any device (tests run both on the CPU)
VARLEN_MIN_PROMPTS = 3  # measured (bench.lab.attention_choice, H200): 16x512 3.4x faster than a loop; 1x8192 1.7x slower


@functools.cache
def varlen_kernel():
    """``fn(q, k, v, starts, longest, scale, window)``: causal FlashAttention over packed prompts through this
    torch's ``varlen_attn`` (its GQA and scale arguments where it has them), or None without one;
    ``fn.windows``: whether it takes sliding windows."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = set(inspect.signature(varlen_attn).parameters)
    gqa, windows, scaled = "enable_gqa" in params, "window_size" in params, "scale" in params
    if not windows and "is_causal" not in params:
        return None

    def run(q, k, v, starts, longest, scale, window, k_starts=None, k_longest=None):
        """``k_starts``/``k_longest``: keys longer than the queries (cached prefixes); causal from the bottom right."""
        kw = {"enable_gqa": True} if gqa else {}
        if scaled:
            kw["scale"] = scale
        elif abs(scale * q.shape[-1] ** 0.5 - 1) > 1e-6:
            q = q * (scale * q.shape[-1] ** 0.5)
        kw.update({"window_size": (window - 1 if window else -1, 0)} if windows else {"is_causal": True})
        if k_starts is None:
            k_starts, k_longest = starts, longest

        def call(keys, values):
            return varlen_attn(q, keys, values, starts, k_starts, longest, k_longest, **kw)
        if not gqa and k.shape[1] != q.shape[1]:
            return GQA_PROBE(call, q, k, v)
        return call(k, v)
    run.windows = windows
    return run


class GqaProbe:
    """Whether a varlen kernel with no ``enable_gqa`` (torch 2.11's) takes fewer K/V heads than query heads as they
    are (FlashAttention's kernel under it does), which saves repeating them (2.5% of a prefill worker's GPU time,
    the 2026-11-27 (6d05ae9) profile). Decided once, on the first such call outside a CUDA graph capture, against the heads
    repeated; until then, and where it failed or differed, the heads are repeated."""

    def __init__(self):
        self.native: bool | None = None

    def __call__(self, call, q, k, v):
        if self.native:
            return call(k, v)
        want = call(*(t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v)))
        if self.native is None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            try:
                got = call(k, v)
                self.native = got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=2e-2,
                                                                         rtol=2e-2)
            except (RuntimeError, ValueError) as e:
                log.info("varlen attention repeats K/V heads for GQA: %s", e)
                self.native = False
            log.info("varlen attention takes GQA's K/V heads as they are: %s", self.native)
        return want


GQA_PROBE = GqaProbe()


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor
    query_starts: list[int]
    context_lens: list[int]
    decode_only: bool
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    segments: list = field(default_factory=list)
    paged: object = None  # ``kernels.paged`` or ``kernels.triton_attention``: decode over ``tables``/``lens`` with fixed shapes
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    window: int = 0
    varlen: tuple | None = None  # (cumulative query starts on the device, longest prompt): fresh prompts, CUDA
    varlen_cached: tuple | None = None  # (context slots, query starts, key starts, longest chunk, longest context)
    on_layer: object = None  # called with each layer's index once it wrote its K/V (LayerProgress.layer_done)
    mixed: int = 0  # the first ``mixed`` rows decode one token each through ``mixed_ops`` (``tables``/``lens``)
    mixed_ops: object = None
    rest: "AttnMeta | None" = None  # how the rows after them attend
    mixed_graph: object = None  # ``cuda_graphs.mixed.MixedGraphs``: attention through its device buffers


def block_slots(tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Flat pool slots of the first ``length`` tokens held by ``tables`` (``[..., blocks]``)."""
    blocks = -(-length // block_size)
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[..., :blocks, None] * block_size + offsets).flatten(-2)[..., :length]


def token_slot(table: list[int], pos: int, block_size: int) -> int:
    """Flat pool slot of position ``pos`` of a sequence whose blocks are ``table`` (host side)."""
    return table[pos // block_size] * block_size + pos % block_size


def build_meta(slot_mapping, query_starts, context_lens, tables, lens, block_size, window, cos, sin,
               varlen: bool = False, decode_rows: int = 0, ops=None) -> AttnMeta:
    """``tables`` ``[batch, blocks]`` and ``lens`` ``[batch]`` on the device; ``varlen``: the model runs in half
    precision on CUDA (what FlashAttention takes); ``decode_rows``: the first rows are one-token decodes that
    attend through ``ops.decode`` (the kernels of the decode graphs) while prompt chunks follow them in the same
    forward (a mixed step reads the weights once); the rest as described above."""
    if decode_rows and decode_rows < len(context_lens):
        meta = AttnMeta(slot_mapping, query_starts, context_lens, False, cos, sin, tables=tables[:decode_rows],
                        lens=lens[:decode_rows], window=window or 0, mixed=decode_rows, mixed_ops=ops)
        meta.rest = build_meta(slot_mapping[decode_rows:], [s - decode_rows for s in query_starts[decode_rows:]],
                               context_lens[decode_rows:], tables[decode_rows:], lens[decode_rows:], block_size,
                               window, None, None, varlen)
        return meta
    decode_only = all(e - s == 1 for s, e in zip(query_starts, query_starts[1:]))
    meta = AttnMeta(slot_mapping, query_starts, context_lens, decode_only, cos, sin)
    device = slot_mapping.device
    if decode_only:
        longest = max(context_lens)
        meta.decode_slots = block_slots(tables, block_size, longest)
        k_pos = torch.arange(longest, device=device)
        mask = k_pos[None, :] < lens[:, None]
        if window:
            mask &= k_pos[None, :] > (lens[:, None] - 1 - window)
        meta.decode_mask = mask
        return meta
    if varlen and _varlen_takes(query_starts, context_lens, window):
        starts = torch.tensor(query_starts, dtype=torch.int32).to(device, non_blocking=True)
        meta.varlen = (starts, max(context_lens))
        meta.window = window
        return meta
    if varlen and _varlen_takes(query_starts, context_lens, window, cached=True):
        meta.varlen_cached = _cached_varlen(query_starts, context_lens, tables, block_size, device)
        meta.window = window
        return meta
    meta.window = window or 0  # the segments' masks hold it; kernels.prefix_split must not take a window
    for i, ctx in enumerate(context_lens):
        n = query_starts[i + 1] - query_starts[i]
        if n == ctx and not window:
            meta.segments.append(None)
            continue
        q_pos = torch.arange(ctx - n, ctx, device=device)
        k_pos = torch.arange(ctx, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        meta.segments.append((block_slots(tables[i], block_size, ctx), mask))
    return meta


def _varlen_takes(query_starts, context_lens, window, cached: bool = False) -> bool:
    """Enough prompts to beat one SDPA call each, a kernel that has the window, and: fresh prompts only; or
    (``cached``) some chunks after a prefix already in the pool."""
    kernel = varlen_kernel() if len(context_lens) >= VARLEN_MIN_PROMPTS else None
    fresh = all(e - s == ctx for s, e, ctx in zip(query_starts, query_starts[1:], context_lens))
    return kernel is not None and (not window or kernel.windows) and fresh != cached


def _cached_varlen(query_starts, context_lens, tables, block_size, device) -> tuple:
    """What one varlen call over prompt chunks with cached prefixes needs: the pool slots of every sequence's
    whole context (gathered into packed keys per layer), cumulative query and key starts, the longest of each."""
    slots = torch.cat([block_slots(tables[i], block_size, ctx) for i, ctx in enumerate(context_lens)])
    k_starts = [0]
    for ctx in context_lens:
        k_starts.append(k_starts[-1] + ctx)
    starts = torch.tensor([query_starts, k_starts], dtype=torch.int32).to(device, non_blocking=True)
    longest = max(e - s for s, e in zip(query_starts, query_starts[1:]))
    return slots, starts[0], starts[1], longest, max(context_lens)


def write_kv(k_cache, v_cache, k, v, slots, scales=None) -> None:
    """The new tokens' K/V into their slots (``scales``: an FP8 pool's ``(k_scale, v_scale)``)."""
    heads, dim = k_cache.shape[-2:]
    ks, vs = scales or (None, None)
    kv_fp8.put(k_cache.view(-1, heads, dim), slots, kv_fp8.store(k_cache, k, ks))
    kv_fp8.put(v_cache.view(-1, heads, dim), slots, kv_fp8.store(v_cache, v, vs))


def attend(q, k, v, k_cache, v_cache, meta: AttnMeta, scale: float, scales=None, stored: bool = False):
    """``q`` ``[tokens, heads, dim]``, ``k``/``v`` ``[tokens, kv_heads, dim]`` -> ``[tokens, heads, dim]``;
    ``scales``: ``(k_scale, v_scale)`` of an FP8 pool (``quant.kv_fp8``), else None; ``stored``: the new K/V are
    in their slots already (``rope_store``)."""
    if meta.paged is not None:
        if not stored:
            meta.paged.store_kv(k_cache, v_cache, k, v, meta.slot_mapping, scales)
        return meta.paged.decode(q, k_cache, v_cache, meta.tables, meta.lens, scale, meta.window, scales=scales)
    if not stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, scales)
    if meta.mixed:
        n = meta.mixed
        out = torch.empty_like(q)
        out[:n] = meta.mixed_ops.decode(q[:n], k_cache, v_cache, meta.tables, meta.lens, scale, meta.window,
                                        scales=scales)
        out[n:] = _attend_written(q[n:], k[n:], v[n:], k_cache, v_cache, meta.rest, scale, scales)
        return out
    return _attend_written(q, k, v, k_cache, v_cache, meta, scale, scales)


def _attend_written(q, k, v, k_cache, v_cache, meta: AttnMeta, scale: float, scales=None) -> torch.Tensor:
    """``attend`` once the new K/V are in the pool (read back dequantized; the new tokens' own K/V as computed)."""
    if meta.decode_only:
        return _decode(q, k_cache, v_cache, meta, scale, scales)
    if meta.varlen is not None:
        return varlen_kernel()(q, k, v, *meta.varlen, scale, meta.window)
    heads, dim = k_cache.shape[-2:]
    ks, vs = scales or (None, None)
    if meta.varlen_cached is not None:
        slots, starts, k_starts, longest, k_longest = meta.varlen_cached
        keys = kv_fp8.read(k_cache.view(-1, heads, dim).index_select(0, slots), ks, q.dtype)
        values = kv_fp8.read(v_cache.view(-1, heads, dim).index_select(0, slots), vs, q.dtype)
        return varlen_kernel()(q, keys, values, starts, longest, scale, meta.window, k_starts, k_longest)
    flat_k, flat_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    out = torch.empty_like(q)
    for i, segment in enumerate(meta.segments):
        s, e = meta.query_starts[i], meta.query_starts[i + 1]
        if segment is None:
            keys, values, mask = k[s:e], v[s:e], None
        else:
            slots, mask = segment
            keys, values = kv_fp8.read(flat_k[slots], ks, q.dtype), kv_fp8.read(flat_v[slots], vs, q.dtype)
        if keys.shape[1] != q.shape[1]:  # repeated heads keep SDPA on its fused kernels (GQA mode is slower there)
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # token-major, as q: one cuDNN plan, any length
        if mask is not None and prefix_split.usable(q.device, q.dtype, meta.window):
            out[s:e] = prefix_split.attend(q[s:e].transpose(0, 1), keys, values, keys.shape[1] - (e - s), scale,
                                           "cudnn").transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                           is_causal=mask is None, scale=scale)  # 4-D: 3-D inputs take the math path
        out[s:e] = o[0].transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta: AttnMeta, scale: float, scales=None) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    flat = meta.decode_slots.flatten()
    ks, vs = scales or (None, None)
    keys = kv_fp8.read(k_cache.view(-1, kv_heads, dim).index_select(0, flat), ks, q.dtype).view(batch, -1, kv_heads, dim)
    values = kv_fp8.read(v_cache.view(-1, kv_heads, dim).index_select(0, flat), vs, q.dtype).view(batch, -1, kv_heads,
                                                                                                   dim)
    if (FORCE_DECODE or ("sdpa" if q.device.type == "cpu" else "matmul")) == "sdpa":
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=meta.decode_mask[:, None, None, :], scale=scale, enable_gqa=True)
        return out.squeeze(2)
    keys, values = keys.permute(0, 2, 3, 1), values.transpose(1, 2)
    scores = torch.matmul(q.view(batch, kv_heads, heads // kv_heads, dim), keys).float() * scale
    scores.masked_fill_(~meta.decode_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(batch, heads, dim)
