"""End to end on a GPU machine: ``pdserve up --transport nccl`` (prefill on
cuda:0, decode on cuda:1, KV over NCCL), or another transport with
``--transport`` (``--up-arg=--device=cuda`` puts both workers on cuda:0),
against plain in-process generation on cuda:0, token for token; prints and
writes a JSON report.

    python -m bench.nccl_e2e [--transport arrow --up-arg=--device=cuda] [--out results.json]"""
from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 20, "pdserve moves KV caches between GPUs",
           "x" * 700]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nccl_e2e.json")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transport", default="nccl")
    ap.add_argument("--up-arg", action="append", default=[], help="extra argument for pdserve up (repeatable)")
    args = ap.parse_args()
    from deploy.local import Cluster
    from engine import EngineConfig, SamplingParams
    from engine.generate import generate
    from engine.engine import Engine

    cluster = Cluster("--transport", args.transport, *args.up_arg, ready_timeout=300)
    try:
        url = cluster.wait_ready().url
        runner = Engine(EngineConfig(device="cuda:0", max_num_seqs=4))
        results = []
        for prompt in PROMPTS:
            _, want, _ = generate(runner, prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0))
            body = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "return_token_ids": True}).json()
            got = body["choices"][0]["token_ids"]
            results.append({"prompt_chars": len(prompt), "equal": got == want, "tokens": len(got), "pdserve": body["pdserve"]})
        time.sleep(1.5)
        workers = httpx.get(url + "/health").json()["workers"]
        report = {"transport": args.transport, "all_equal": all(r["equal"] for r in results),
                  "results": results, "prefill": workers["prefill"][0], "decode": workers["decode"][0]}
    finally:
        cluster.stop()
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
