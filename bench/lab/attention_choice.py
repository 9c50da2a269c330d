"""Which attention kernels the CUDA path uses, chosen by measurement.

Candidates on the engine's paged pool (``[blocks, block_size, kv_heads, head_dim]`` per layer, block tables with
shuffled block ids), Mistral-7B attention shape (32 query heads, 8 KV heads, head dim 128, bf16):

decode (one query per sequence)
  triton        engine.kernels.triton_attention.decode (split-K over the block table; what the CUDA graphs capture)
  torch_paged   engine.kernels.paged.decode (fixed-shape torch: gather + grouped matmuls)
  flex          torch flex_attention (compiled) with a paged block mask built from the tables
  varlen_paged  torch.nn.attention.varlen.varlen_attn with block_table (FlashAttention), where this torch has it
prefill (fresh prompts, causal, packed)
  sdpa_loop     one SDPA call per sequence (the engine's portable path)
  varlen        varlen_attn over the packed prompts (FlashAttention)
  flex          flex_attention with a document-causal block mask

Every candidate is checked against an fp32 reference (gather + softmax) before it is timed (CUDA events,
median of 30 after warm-up). FlashInfer is a candidate the issue names; it is reported as not installable
when ``import flashinfer`` fails (its wheel and dependencies do not fit the GPU machines' offline install).

    python -m bench.lab.attention_choice --out bench/results/attention-choice
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback

import torch

H, HKV, D = 32, 8, 128


def pool(blocks: int, bs: int, dtype, device):
    k = torch.randn(blocks, bs, HKV, D, dtype=dtype, device=device)
    return k, torch.randn_like(k)


def tables_for(batch: int, ctx: int, bs: int, blocks: int, device):
    per = -(-ctx // bs)
    ids = torch.randperm(blocks, device="cpu")[:batch * per].view(batch, per)
    return ids.to(device=device, dtype=torch.int32), torch.full((batch,), ctx, dtype=torch.int32, device=device)


def reference_decode(q, kc, vc, tables, lens, scale):
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = (tables[b].long()[:, None] * kc.shape[1] + torch.arange(kc.shape[1], device=q.device)).flatten()[:n]
        k = kc.view(-1, HKV, D)[slots].float().repeat_interleave(H // HKV, 1)
        v = vc.view(-1, HKV, D)[slots].float().repeat_interleave(H // HKV, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, -1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def flex_decode_fn(kc, vc, tables, lens, scale):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    blocks, bs = kc.shape[:2]
    batch, width = tables.shape
    owner = torch.full((batch, blocks), -1, dtype=torch.int32, device=kc.device)
    owner.scatter_(1, tables.long(), torch.arange(width, dtype=torch.int32, device=kc.device).expand(batch, -1))

    def mask_mod(b, h, q_idx, kv_idx):
        logical = owner[b, kv_idx // bs]
        return (logical >= 0) & (logical * bs + kv_idx % bs < lens[b])

    counts = torch.full((batch, 1, 1), width, dtype=torch.int32, device=kc.device)
    indices = torch.zeros(batch, 1, 1, blocks, dtype=torch.int32, device=kc.device)
    indices[:, 0, 0, :width] = tables
    mask = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(128, bs),
                                    mask_mod=mask_mod, seq_lengths=(1, blocks * bs))
    k = kc.view(1, blocks * bs, HKV, D).transpose(1, 2)
    v = vc.view(1, blocks * bs, HKV, D).transpose(1, 2)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q):
        return compiled(q[:, :, None, :], k, v, block_mask=mask, scale=scale, enable_gqa=True)[:, :, 0, :]
    return run


def varlen_paged_fn(kc, vc, tables, lens, scale):
    from torch.nn.attention.varlen import varlen_attn

    batch = tables.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=kc.device)
    max_k = int(lens.max())
    cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)

    def run(q):
        return varlen_attn(q, kc, vc, cu, cu_k, 1, max_k, scale=scale, enable_gqa=True, seqused_k=lens,
                           block_table=tables)
    return run


def decode_candidates(kc, vc, tables, lens, scale):
    from engine.kernels import paged
    out = {"torch_paged": lambda q: paged.decode(q, kc, vc, tables, lens, scale)}
    try:
        from engine.kernels import triton_attention as triton_ops
        out["triton"] = lambda q: triton_ops.decode(q, kc, vc, tables, lens, scale)
    except ImportError as e:
        out["triton"] = e
    for name, make in (("flex", flex_decode_fn), ("varlen_paged", varlen_paged_fn)):
        try:
            out[name] = make(kc, vc, tables, lens, scale)
        except Exception as e:  # a torch without the API
            out[name] = e
    return out


def prefill_candidates(lens, scale, device):
    import torch.nn.functional as F
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    total, longest = sum(lens), max(lens)

    def sdpa_loop(q, k, v):
        out = torch.empty_like(q)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            kk = k[s:e].transpose(0, 1).repeat_interleave(H // HKV, 0)
            vv = v[s:e].transpose(0, 1).repeat_interleave(H // HKV, 0)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kk[None], vv[None], is_causal=True,
                                               scale=scale)
            out[s:e] = o[0].transpose(0, 1)
        return out

    out = {"sdpa_loop": sdpa_loop}
    from engine.attention import varlen_kernel
    run = varlen_kernel()
    out["varlen"] = (lambda q, k, v: run(q, k, v, cu, longest, scale, 0)) if run else RuntimeError("no varlen_attn")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))

        def causal_doc(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
        mask = create_block_mask(causal_doc, None, None, total, total, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex(q, k, v):
            return compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            block_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        out["flex"] = flex
    except Exception as e:
        out["flex"] = e
    return out


def reference_prefill(q, k, v, lens, scale):
    out, s = [], 0
    for n in lens:
        qq, kk = q[s:s + n].float(), k[s:s + n].float().repeat_interleave(H // HKV, 1)
        vv = v[s:s + n].float().repeat_interleave(H // HKV, 1)
        w = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        w.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(w, -1), vv))
        s += n
    return torch.cat(out)


def timed(fn, *args, iters: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    if not torch.cuda.is_available():
        started = time.perf_counter()
        for _ in range(3):
            fn(*args)
        return (time.perf_counter() - started) / 3 * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(candidates, args, reference, tol):
    row = {}
    for name, fn in candidates.items():
        if isinstance(fn, Exception):
            row[name] = {"error": f"{type(fn).__name__}: {fn}"[:300]}
            continue
        try:
            started = time.perf_counter()
            err = (fn(*args).float() - reference).abs().max().item()
            first_s = time.perf_counter() - started
            row[name] = {"ms": round(timed(fn, *args), 4), "max_abs_err": err, "ok": err < tol,
                         "first_call_s": round(first_s, 2)}
        except Exception as e:
            traceback.print_exc()
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/attention-choice")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="small cases (a CPU check of the script itself)")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, bs = torch.bfloat16 if device.type == "cuda" else torch.float32, a.block_size
    torch.manual_seed(0)
    scale = 1 / math.sqrt(D)
    try:
        import flashinfer  # noqa: F401
        flashinfer_state = "importable (not wired in)"
    except ImportError as e:
        flashinfer_state = f"not installable here: {e}"
    decode_cases = ((2, 40),) if a.quick else ((1, 512), (1, 4096), (32, 512), (32, 2048), (64, 1024))
    prefill_cases = ((3, 40),) if a.quick else ((16, 512), (4, 2048), (1, 8192))
    report = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__, "block_size": bs,
              "flashinfer": flashinfer_state, "decode": {}, "prefill": {}}
    for batch, ctx in decode_cases:
        blocks = batch * -(-ctx // bs) + 8
        kc, vc = pool(blocks, bs, dtype, device)
        tables, lens = tables_for(batch, ctx, bs, blocks, device)
        q = torch.randn(batch, H, D, dtype=dtype, device=device)
        ref = reference_decode(q, kc, vc, tables, lens, scale)
        row = measure(decode_candidates(kc, vc, tables, lens, scale), (q,), ref, 2e-2)
        report["decode"][f"b{batch}_ctx{ctx}"] = row
        print("decode", batch, ctx, {k: v.get("ms", v.get("error", "")[:60]) for k, v in row.items()}, flush=True)
    for n, length in prefill_cases:
        lens = [length] * n
        total = n * length
        q = torch.randn(total, H, D, dtype=dtype, device=device)
        k = torch.randn(total, HKV, D, dtype=dtype, device=device)
        v = torch.randn_like(k)
        ref = reference_prefill(q, k, v, lens, scale)
        row = measure(prefill_candidates(lens, scale, device), (q, k, v), ref, 2e-2)
        report["prefill"][f"{n}x{length}"] = row
        print("prefill", n, length, {k: v.get("ms", v.get("error", "")[:60]) for k, v in row.items()}, flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"flashinfer": flashinfer_state}))


if __name__ == "__main__":
    main()
