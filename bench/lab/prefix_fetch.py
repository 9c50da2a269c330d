"""A prefix that another worker holds, fetched over the cluster's transport, against computing it.

    python -m bench.lab.prefix_fetch --tokens 16384 --up-args "--transport nccl --gpus 1 --model llama-3.1-8b \\
        --load-format dummy --dtype bfloat16 --max-model-len 32768 --kv-budget 4G" --out bench/out/prefix-fetch.json

One disaggregated cluster (``pdserve up``: a prefill and a decode worker, ``--policy kv_aware``), prompts of
``--tokens`` token ids, one token out, streamed:

- ``cold``: a new prompt, computed by the prefill worker and moved whole to the decode worker;
- ``fetched``: the decode worker's pool (``--kv-budget``, small) has since let that prompt's blocks go (other
  prompts pushed them out), the prefill worker still holds them: the same prompt with a new last block is computed
  only for that block and its whole KV moves to the decode worker over the transport.

The first token comes from the prefill worker before the KV moves, so the figure that counts the fetch is the time to
the second token: the decode worker makes it only once the whole KV is in its pool. Each is the median of
``--rounds`` prompts (after one of each for warm-up). The report: both times for both prompts, their ratios, what the
prefill worker took from its cache and the KV bytes moved (the response's ``pdserve`` block). The bar this checks:
a prefix fetched from another worker at least 5x faster than computing it (at 16k tokens), on the second token."""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time

import httpx

from deploy.local import Cluster


def first_token(url: str, model: str, ids: list[int]) -> tuple[float, float, dict]:
    """Seconds to the first streamed token and to the end of the stream (the second token: ``max_tokens`` 2), and
    the final chunk's ``pdserve`` block."""
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, took, block, usage = time.perf_counter(), [], {}, {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not took and any(c.get("text") is not None for c in chunk.get("choices") or []):
                took.append(time.perf_counter() - start)
            block, usage = chunk.get("pdserve") or block, chunk.get("usage") or usage
    if not took or usage.get("completion_tokens") != 2:
        raise RuntimeError(f"{usage.get('completion_tokens')} tokens where 2 were asked for")
    return took[0], time.perf_counter() - start, block  # the stream ends with the second token


def pushed_out(cluster: Cluster, model: str, rng, tokens: int, vocab: int, prompts: int) -> None:
    """Other prompts through the cluster, enough to push a prompt's blocks out of the decode worker's pool."""
    for _ in range(prompts):
        first_token(cluster.url, model, [rng.randrange(3, vocab) for _ in range(tokens)])


def run(args) -> dict:
    cluster = Cluster("--policy", "kv_aware", *shlex.split(args.up_args)).wait_ready()
    try:
        health = httpx.get(cluster.url + "/health", timeout=10).json()
        model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        decode = health["workers"]["decode"][0]
        vocab = min(int(decode.get("vocab_size") or args.vocab), args.vocab)
        pool_tokens = int(decode.get("kv_blocks") or 0) * int(decode.get("kv_block_size") or 16)
        push = pool_tokens // args.tokens + 2
        rng = random.Random(0)
        cold, fetched, blocks = [], [], []  # (first, second) token times
        for i in range(args.rounds + 1):
            prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
            took = first_token(cluster.url, model, prompt)[:2]
            pushed_out(cluster, model, rng, args.tokens, vocab, push)
            again = prompt[:-16] + [rng.randrange(3, vocab) for _ in range(16)]
            *took_again, block = first_token(cluster.url, model, again)
            if i:  # the first round warms both paths up
                cold.append(took), fetched.append(took_again), blocks.append(block)
    finally:
        cluster.stop()
    out = {"command": "python -m bench.lab.prefix_fetch " + " ".join(args.argv), "tokens": args.tokens,
           "pushed_between": push, "decode_pool_tokens": pool_tokens, "cold_s": cold, "fetched_s": fetched}
    for i, which in enumerate(("first", "second")):
        for name, runs in (("cold", cold), ("fetched", fetched)):
            out[f"{name}_{which}_token_median_s"] = statistics.median(r[i] for r in runs)
        out[f"speedup_{which}_token"] = out[f"cold_{which}_token_median_s"] / out[f"fetched_{which}_token_median_s"]
    out["fetched_pdserve"] = [{k: b.get(k) for k in ("cached_tokens_by_tier", "kv_bytes", "wire", "transfer_total",
                                                     "uncached_tokens", "prefill") if k in b} for b in blocks]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.prefix_fetch")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this (and the model's vocabulary)")
    ap.add_argument("--up-args", default="--transport tcp --kv-budget 64M",
                    help="pdserve up arguments (a prefill and a decode worker; a small decode --kv-budget)")
    ap.add_argument("--out", default="bench/out/prefix-fetch.json")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "fetched_pdserve"}, indent=1))
    print(json.dumps(report["fetched_pdserve"][-1], indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
