"""The measurements of ``pdserve bench kernels``, one function per kind of kernel. Each returns rows of
``{"name", "ms", "bytes" or "flops", ...}``; ``bench.kernels`` turns them into fractions of the device's limits
measured in the same run (``limits``). Times are device times: CUDA events around repeats (median of rounds), or
the wall clock on the CPU."""
from __future__ import annotations

import statistics
import time

import torch


def timed(fn, device, reps: int = 20, rounds: int = 5, graph: bool = True) -> float:
    """Median milliseconds of one ``fn()`` (after a warm-up call). On CUDA ``reps`` calls are captured in one CUDA
    graph and replayed, so small kernels are timed as they run inside the engine's decode graph, without the
    host's launch cost (``graph=False``: launched one by one)."""
    fn()
    if device.type == "cuda" and graph:
        return _graph_timed(fn, device, reps, rounds)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) * 1e3 / reps)
    return statistics.median(times)


def _graph_timed(fn, device, reps: int, rounds: int) -> float:
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del g
    return statistics.median(times)


def limits(device, dtype, size_mib: int) -> dict:
    """Measured copy bandwidth (bytes read + written per second, a device-to-device copy of ``size_mib``), read
    bandwidth (a sum over the same bytes) and dense matmul rate in ``dtype``."""
    n = size_mib * 2**20 // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), device, reps=10, graph=False)  # captured, a copy is a DMA-engine node
    read_ms = timed(lambda: a.sum(dtype=torch.float32), device, reps=10)
    side = 8192 if device.type == "cuda" else 1024
    x, y = (torch.randn(side, side, dtype=dtype, device=device) for _ in range(2))
    mm_ms = timed(lambda: x @ y, device, reps=5)

    return {"copy_GBps": 2 * n * 2 / copy_ms / 1e6, "read_GBps": n * 2 / read_ms / 1e6,
            "matmul_TFLOPs": 2 * side ** 3 / mm_ms / 1e9, "matmul_side": side, "buffer_MiB": size_mib}


def paged_pool(batch: int, ctx: int, kv_heads: int, dim: int, block: int, dtype, device, gen):
    """A pool holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks: ``(k, v, tables, lens)``."""
    per = -(-ctx // block)
    blocks = batch * per + 1
    k = torch.empty(blocks, block, kv_heads, dim, dtype=dtype, device=device).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    order = torch.randperm(blocks - 1, generator=gen, device=device)[:batch * per]
    return k, v, order.view(batch, per).int(), torch.full((batch,), ctx, dtype=torch.int32, device=device)


def decode_attention(ops, ref, spec, cases, dtype, device, block: int, configs=None, fp8: bool = False) -> list:
    """Paged decode attention (``ops.decode``) per ``(batch, context)``: checked against ``ref.decode`` (fp32)
    first, then timed with each of ``configs`` (``ops.DecodeConfig``; None: the kernel's own choice). ``fp8``: over
    an FP8 pool (``quant.kv_fp8``, scales 0.5)."""
    from engine.quant import kv_fp8

    gen = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = []
    for batch, ctx in cases:
        k, v, tables, lens = paged_pool(batch, ctx, kv_heads, dim, block, dtype, device, gen)
        q = torch.empty(batch, heads, dim, dtype=dtype, device=device).normal_(generator=gen)
        scale, scales = dim ** -0.5, None
        if fp8:
            scales = (0.5, 0.5)
            k, v = kv_fp8.quantize(k, 0.5), kv_fp8.quantize(v, 0.5)
        want = ref.decode(q[:2].float(), k.float() * (0.5 if fp8 else 1), v.float() * (0.5 if fp8 else 1), tables[:2],
                          lens[:2], scale)
        kv_bytes = 2 * batch * ctx * kv_heads * dim * k.element_size()
        for config in configs or [None]:
            kw = {"config": config} if config is not None else {}
            if fp8:
                kw["scales"] = scales
            got = ops.decode(q, k, v, tables, lens, scale, **kw)
            err = (got[:2].float() - want).abs().max().item()
            ms = timed(lambda: ops.decode(q, k, v, tables, lens, scale, **kw), device)
            row = {"name": f"decode b{batch} ctx{ctx}", "batch": batch, "context": ctx, "ms": ms,
                   "bytes": kv_bytes + 2 * q.numel() * q.element_size(), "max_abs_err": err, "ok": err < 5e-2}
            if config is not None:
                row["config"] = config.as_dict()
            rows.append(row)

    return rows


def prefill_attention(spec, cases, dtype, device) -> list:
    """Causal attention over packed fresh prompts, the engine's prefill path (``engine.attention``)."""
    from engine.attention import build_meta, attend

    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = []
    for count, length in cases:
        n = count * length
        q = torch.randn(n, heads, dim, dtype=dtype, device=device)
        k, v = (torch.randn(n, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
        block = 16
        kc, vc = (torch.zeros(-(-n // block) + 1, block, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
        starts = [i * length for i in range(count + 1)]
        per = -(-length // block)
        tables = torch.arange(count * per, device=device).view(count, per)
        lens = torch.full((count,), length, device=device)
        meta = build_meta(torch.arange(n, device=device), starts, [length] * count, tables, lens, block, 0, None,
                          None, varlen=device.type == "cuda" and dtype != torch.float32)
        ms = timed(lambda: attend(q, k, v, kc, vc, meta, dim ** -0.5), device, reps=5, graph=False)
        flops = 4 * heads * dim * count * length * (length + 1) / 2
        rows.append({"name": f"prefill {count}x{length}", "kernel": "varlen" if meta.varlen else "sdpa", "ms": ms,
                     "flops": flops})
    return rows


def layer_kernels(layers, ops, spec, token_counts, dtype, device) -> list:
    """The fused elementwise kernels of a layer (``layers``: ``triton_layers`` or None for the torch forms) at each
    token count: bytes each reads and writes."""
    from engine.models.llama import RMSNorm
    from engine.models.rope import Rotary

    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    norm = RMSNorm(h, 1e-5).to(device, dtype)
    norm.kernels = layers
    rotary = Rotary(d, 4096, spec.rope_theta).to(device)
    size = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for n in token_counts:
        x, r = (torch.randn(n, h, dtype=dtype, device=device) for _ in range(2))
        gate_up = torch.randn(n, 2 * inter, dtype=dtype, device=device)
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
        kc, vc = (torch.zeros(n // 16 + 1, 16, kv_heads, d, dtype=dtype, device=device) for _ in range(2))
        pos = torch.arange(n, device=device)
        cos, sin = rotary.cos[pos], rotary.sin[pos]
        silu = layers.silu_mul if layers else (lambda t: torch.nn.functional.silu(t[:, :inter]) * t[:, inter:])
        cases = {
            "rmsnorm": (lambda: norm(x), 2 * n * h * size),
            "add_rmsnorm": (lambda: norm(x, r), 4 * n * h * size),
            "silu_mul": (lambda: silu(gate_up), 3 * n * inter * size),
            "rope_store": (lambda: ops.rope_store(qkv, cos, sin, kc, vc, pos, heads, kv_heads),
                           2 * qkv.numel() * size + 2 * cos.numel() * 4),
        }
        for name, (fn, nbytes) in cases.items():
            rows.append({"name": f"{name} n{n}", "tokens": n, "ms": timed(fn, device), "bytes": nbytes})
    return rows


L2_BYTES = 256 << 20  # comfortably more than any L2 (H100 50 MB, H200 60 MB)


def copies_past_l2(make, nbytes: int, device) -> list:
    """As many ``make()`` results (``nbytes`` each) as it takes to hold more than any GPU's L2 cache (two on a CPU,
    whose timings here are only the torch forms' smoke test)."""
    return [make() for _ in range(max(2, -(-L2_BYTES // nbytes) if device.type == "cuda" else 2))]


def timed_rotating(fn, items: list, device) -> float:
    """``timed`` over calls ``fn(item)`` that take ``items`` in turn (weights larger than L2 together, so each call
    reads its weight from memory, as a decode step does, not from L2 as a repeated call on one weight would)."""
    turn = iter(range(1 << 30))
    reps = len(items) * 4 if len(items) < 8 else len(items)
    return timed(lambda: fn(items[next(turn) % len(items)]), device, reps=reps)


def gemms(spec, batches, dtype, device, tp: int = 1) -> list:
    """The decode step's matmuls at one rank's shapes (``x @ W.T``, weights in ``dtype``, read from memory):
    bytes are the weights read plus the activations; flops for comparison with the matmul rate."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d // tp, h), "o": (h, spec.num_heads * d // tp),
              "gate_up": (2 * inter // tp, h), "down": (h, inter // tp), "lm_head": (spec.vocab_size // tp, h)}
    rows = []
    for name, (out_f, in_f) in shapes.items():
        weights = copies_past_l2(lambda: torch.randn(out_f, in_f, dtype=dtype, device=device) * 0.02,
                                 out_f * in_f * torch.finfo(dtype).bits // 8, device)
        w = weights[0]
        for m in batches:
            x = torch.randn(m, in_f, dtype=dtype, device=device)
            ms = timed_rotating(lambda w: torch.nn.functional.linear(x, w), weights, device)
            rows.append({"name": f"{name} m{m}", "gemm": name, "m": m, "ms": ms,
                         "bytes": (w.numel() + m * (in_f + out_f)) * w.element_size(), "flops": 2 * m * in_f * out_f})

    return rows
