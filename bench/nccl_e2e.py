"""End to end on a GPU machine: ``pdserve up --transport nccl`` (prefill on
cuda:0, decode on cuda:1, KV over NCCL), or another transport with
``--transport`` (``--up-arg=--device=cuda`` puts both workers on cuda:0),
against plain in-process generation on cuda:0, token for token; prints and
writes a JSON report.

    python -m bench.nccl_e2e [--transport arrow --up-arg=--device=cuda] [--out results.json]"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import httpx

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 20, "pdserve moves KV caches between GPUs",
           "x" * 700]


def wait_healthy(url: str, proc, timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve up exited with code {proc.returncode}")
        try:
            health = httpx.get(url + "/health", timeout=2).json()
            if health.get("status") == "ok":
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("cluster not healthy in time")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nccl_e2e.json")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transport", default="nccl")
    ap.add_argument("--up-arg", action="append", default=[], help="extra argument for pdserve up (repeatable)")
    args = ap.parse_args()
    from control.ports import free_port
    from engine import EngineConfig, SamplingParams
    from engine.generate import generate
    from engine.engine import Engine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "up",
                             "--transport", args.transport, "--port", str(port), *args.up_arg])
    try:
        wait_healthy(url, proc)
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
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
