"""What a prompt chunk after a cached prefix costs in attention, by kernel, and what one long prompt costs the engine.

A long prompt is prefilled in chunks; every chunk after the first attends to its own tokens causally and to all the
keys before it, which sit in the paged pool: causal from the bottom right. Candidates, one chunk of ``--chunk``
queries after prefixes of ``--prefixes`` tokens, Llama-3-8B / Mistral-7B attention (32 query heads, 8 KV heads,
head dim 128, bf16), the prefix's keys gathered from a pool of shuffled blocks first (as the engine does):

  sdpa_mask       the engine's path until now: keys repeated to 32 heads, SDPA with a boolean mask
  varlen          torch's varlen_attn (FlashAttention) with the keys' own starts: causal from the bottom right, GQA
  sdpa_lower_right_{flash,efficient,cudnn}  SDPA with ``causal_lower_right`` under one backend each
  split_{cudnn,flash}  the chunk against the prefix unmasked and against itself causal, two calls of one fused
                  kernel, merged by their log-sum-exps
  fresh_causal    the first chunk's case for scale: SDPA ``is_causal`` over chunk+prefix tokens, no prefix

Each is checked against the float32 reference on a small case first, then timed (CUDA events, median of 10 after
3 warm-ups) and reported in TFLOP/s of causal attention work (4 x heads x dim x queries x mean keys). ``--engine``:
one prompt of each length of ``--lengths`` through the engine (``--model``, dummy weights, no prefix cache), time to
its first token (the second prompt of each length: the first compiles), as TFLOP/s of the whole forward (2 x the
parameters outside the embeddings x n + 2 x layers x heads x dim x n^2, the causal attention), for each step budget
of ``--budgets`` (the chunk a prompt is prefilled in: ``--max-batched-tokens``)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch
import torch.nn.functional as F

H, HKV, D, BS = 32, 8, 128, 16


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(prefix: int, chunk: int, dtype=torch.bfloat16, device="cuda"):
    """q of the chunk, and the whole context's keys/values gathered from a shuffled paged pool."""
    n = prefix + chunk
    blocks = -(-n // BS)
    k_pool = torch.randn(blocks, BS, HKV, D, dtype=dtype, device=device)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(blocks, device=device)
    slots = (table[:, None] * BS + torch.arange(BS, device=device)).flatten()[:n]
    q = torch.randn(chunk, H, D, dtype=dtype, device=device)
    return q, k_pool.view(-1, HKV, D), v_pool.view(-1, HKV, D), slots


def candidates(prefix: int, chunk: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n, scale = prefix + chunk, D ** -0.5

    def gathered(flat_k, flat_v, slots):
        return flat_k.index_select(0, slots), flat_v.index_select(0, slots)

    def sdpa_mask(q, flat_k, flat_v, slots):
        k, v = gathered(flat_k, flat_v, slots)
        k, v = k.transpose(0, 1).repeat_interleave(H // HKV, 0), v.transpose(0, 1).repeat_interleave(H // HKV, 0)
        q_pos = torch.arange(prefix, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                              scale=scale)[0].transpose(0, 1)

    def varlen(q, flat_k, flat_v, slots):
        from engine.attention import varlen_kernel

        k, v = gathered(flat_k, flat_v, slots)
        qs = torch.tensor([0, chunk], dtype=torch.int32, device=q.device)
        ks = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        return varlen_kernel()(q, k, v, qs, chunk, scale, None, ks, n)

    def lower_right(backend):
        def run(q, flat_k, flat_v, slots):
            k, v = gathered(flat_k, flat_v, slots)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=causal_lower_right(
                    chunk, n), scale=scale, enable_gqa=True)[0].transpose(0, 1)
        return run

    def split(op):
        """The chunk against the prefix (no mask) and against itself (causal), each with its log-sum-exp from one of
        torch's fused kernels (``op``: cudnn | flash), merged exactly."""
        def attend(q4, k4, v4, causal):
            if op == "cudnn":
                out = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                         scale=scale)
            else:
                out = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False, scale=scale)
            return out[0], out[1].float().reshape(out[0].shape[:3])

        def run(q, flat_k, flat_v, slots):
            k, v = gathered(flat_k, flat_v, slots)
            k = k.transpose(0, 1).repeat_interleave(H // HKV, 0)[None]
            v = v.transpose(0, 1).repeat_interleave(H // HKV, 0)[None]
            q4 = q.transpose(0, 1)[None]
            o1, l1 = attend(q4, k[:, :, :prefix], v[:, :, :prefix], False)
            o2, l2 = attend(q4, k[:, :, prefix:], v[:, :, prefix:], True)
            top = torch.maximum(l1, l2)
            w1, w2 = (l1 - top).exp()[..., None], (l2 - top).exp()[..., None]
            return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)[0].transpose(0, 1)
        return run

    return {"sdpa_mask": sdpa_mask, "varlen": varlen, "split_cudnn": split("cudnn"), "split_flash": split("flash"),
            "sdpa_lower_right_flash": lower_right(SDPBackend.FLASH_ATTENTION),
            "sdpa_lower_right_efficient": lower_right(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa_lower_right_cudnn": lower_right(SDPBackend.CUDNN_ATTENTION)}


def reference(q, flat_k, flat_v, slots, prefix):
    k = flat_k[slots].float().transpose(0, 1).repeat_interleave(H // HKV, 0)
    v = flat_v[slots].float().transpose(0, 1).repeat_interleave(H // HKV, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k) * D ** -0.5
    n = k.shape[1]
    scores.masked_fill_(torch.arange(n, device=q.device)[None, :] > torch.arange(prefix, n, device=q.device)[:, None],
                        float("-inf"))
    return torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v)


def kernels(prefixes: list[int], chunk: int) -> list[dict]:
    rows = []
    checks = {}
    small = case(256, 128)
    want = reference(*small, 256)
    for name, fn in candidates(256, 128).items():
        try:
            checks[name] = float((fn(*small).float() - want).abs().max())
        except Exception as e:  # a backend this torch or card refuses
            checks[name] = f"{type(e).__name__}: {e}"[:160]
    for prefix in prefixes:
        q, k, v, slots = case(prefix, chunk)
        flops = 4 * H * D * chunk * (prefix + (chunk + 1) / 2)
        row = {"prefix": prefix, "chunk": chunk, "tflop": flops / 1e12}
        for name, fn in candidates(prefix, chunk).items():
            if not isinstance(checks[name], float) or checks[name] > 2e-2:
                row[name] = None
                continue
            ms = timed(lambda: fn(q, k, v, slots))
            row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        fresh = torch.randn(1, H, prefix + chunk, D, dtype=q.dtype, device=q.device)
        kf = torch.randn(1, H, prefix + chunk, D, dtype=q.dtype, device=q.device)
        ms = timed(lambda: F.scaled_dot_product_attention(fresh, kf, kf, is_causal=True))
        whole = 4 * H * D * (prefix + chunk) * (prefix + chunk + 1) / 2
        row["fresh_causal"] = {"ms": ms, "tflops": whole / ms / 1e9, "tokens": prefix + chunk}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return [{"checks_max_abs_err": checks}] + rows


def engine_prefill(model: str, lengths: list[int], max_len: int, budget: int) -> list[dict]:
    import time

    from bench.engine import _seqs
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 max_model_len=max_len, max_num_seqs=4, kv_budget_bytes=40 << 30,
                                 max_batched_tokens=budget,
                                 prefix_caching=False))  # every prompt computed whole
    spec = engine.model.spec
    embeddings = 2 * spec.vocab_size * spec.hidden_size  # a lookup and the last token's logits: no n-token matmul
    matmul = sum(p.numel() for p in engine.model.parameters()) - embeddings
    vocab = min(spec.vocab_size, engine.tokenizer.vocab_size)
    rng = random.Random(0)
    rows = []

    def first_token_s(n: int) -> tuple[float, int]:
        seq = _seqs(engine, [[rng.randrange(3, vocab) for _ in range(n)]], [1])[0]
        torch.cuda.synchronize()
        start, steps = time.perf_counter(), 0
        engine.add(seq)
        while not seq.output_ids:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        engine.free(seq)
        return time.perf_counter() - start, steps

    for n in lengths:
        first_token_s(n)  # kernels compiled and cuDNN plans built for this length's chunks
        s, steps = first_token_s(n)
        flops = 2 * matmul * n + 2 * spec.num_layers * spec.num_heads * spec.head_dim * n * n
        rows.append({"tokens": n, "s": s, "steps": steps, "tflops": flops / s / 1e12,
                     "budget_tokens": engine.scheduler.max_batched_tokens})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.prefix_attention")
    ap.add_argument("--prefixes", default="8192,24576,57344,94208")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="8192,32768,65536,102400")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--budgets", default="8192", help="--engine: step budgets (tokens a step computes), one engine each")
    ap.add_argument("--out", default="bench/out/prefix-attention.json")
    args = ap.parse_args(argv)
    report = {"command": "python -m bench.lab.prefix_attention " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.engine:
        lengths = [int(x) for x in args.lengths.split(",")]
        report["engine"] = [row for budget in args.budgets.split(",")
                            for row in engine_prefill(args.model, lengths, args.max_model_len, int(budget))]
    else:
        report["kernels"] = kernels([int(x) for x in args.prefixes.split(",")], args.chunk)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
