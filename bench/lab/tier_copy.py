"""How fast the host tier moves KV, against the pinned copy limit, and what a prefix from host memory saves.

    python -m bench.lab.tier_copy --model llama-3.1-8b --tokens 16384 --out bench/out/tier-copy.json

One engine (``--model``, dummy bf16 weights, a pool of ``--kv-budget`` and a host tier of ``--host``):

- ``pinned``: one contiguous pinned host buffer of a prefix's KV bytes copied to the GPU and back (the link's
  limit as torch reaches it);
- ``offload`` / ``write_ahead`` / ``load``: the same bytes as the tier moves them (``kvcache.HostTier``: a batch
  the pool evicts, a batch of idle blocks written ahead, a batch loaded back), timed with the
  device synchronized, and their rate as a fraction of ``pinned``;
- ``ttft``: a prompt of ``--tokens`` tokens computed (cold), then, its blocks pushed out of the pool into the tier
  by other prompts, the same prompt again (its prefix loaded from host memory): time to first token (the token on
  the host), and the ratio (the bar: at most 0.15), twice with new prompts, the second the figure. Beside them,
  ``*_device_idle_s``: until the device has also finished what the step started on other streams (the host tier's
  writes ahead of the next evictions, 2 GB at 16k tokens), which no token waits for."""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

import kvcache
from bench.engine import _seqs
from engine import EngineConfig
from engine.engine import Engine


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_rates(engine, blocks: int) -> dict:
    pool, tier = engine.pool.stacked, engine.tiers.host
    nbytes = blocks * tier.slots[0].numel() * tier.slots.element_size()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)
    h2d = min(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(3))
    d2h = min(timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(3))
    ids = list(range(blocks))
    offload = timed(lambda: tier.offload_many([(1_000_000 + b, b) for b in ids]))
    ahead = timed(lambda: tier.write_ahead([(2_000_000 + b, b) for b in ids]))
    handles = tier.match([1_000_000 + b for b in ids])
    kvcache.pin(handles)
    load = timed(lambda: kvcache.load([(h, b) for h, b in zip(handles, ids)]))
    rates = {"bytes": nbytes, "pinned_h2d_gb_s": nbytes / h2d / 1e9, "pinned_d2h_gb_s": nbytes / d2h / 1e9,
             "offload_gb_s": nbytes / offload / 1e9, "write_ahead_gb_s": nbytes / ahead / 1e9,
             "load_gb_s": nbytes / load / 1e9}
    rates["load_of_pinned"] = rates["load_gb_s"] / rates["pinned_h2d_gb_s"]
    rates["offload_of_pinned"] = rates["offload_gb_s"] / rates["pinned_d2h_gb_s"]
    rates["write_ahead_of_pinned"] = rates["write_ahead_gb_s"] / rates["pinned_d2h_gb_s"]
    return rates


def first_token_s(engine, prompt: list[int]) -> tuple[float, dict]:
    seq = _seqs(engine, [prompt], [1])[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add(seq)
    while not seq.output_ids:
        engine.step()
    took = time.perf_counter() - start  # the token is on the host: what a client waits for
    torch.cuda.synchronize()
    idle = time.perf_counter() - start  # and every copy started beside the step (writes ahead) done too
    while engine.has_work:
        engine.step()
    return took, idle, dict(seq.cached_by_tier)


def ttft(engine, tokens: int, rng) -> dict:
    """Twice, each time with a new prompt: computed cold, pushed out of the pool, again from host memory. The
    second time is the figure (the first pays for what a worker does once, e.g. attention plans for new shapes)."""
    vocab = min(engine.model.spec.vocab_size, engine.tokenizer.vocab_size)
    first_token_s(engine, [rng.randrange(3, vocab) for _ in range(tokens)])  # compiles, plans, allocator
    runs = []
    for _ in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
        cold, cold_idle, _ = first_token_s(engine, prompt)
        pool_tokens = engine.num_blocks * engine.block_size
        for _ in range(pool_tokens // tokens + 2):  # enough other prompts to push it out of the pool
            first_token_s(engine, [rng.randrange(3, vocab) for _ in range(tokens)])
        warm, warm_idle, tiers = first_token_s(engine, prompt)
        runs.append({"cold_s": cold, "from_host_s": warm, "ratio": warm / cold, "cached_by_tier": tiers,
                     "cold_device_idle_s": cold_idle, "from_host_device_idle_s": warm_idle})
    return {"tokens": tokens, **runs[1], "first": runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.tier_copy")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv-budget", default="8", help="GiB of GPU pool")
    ap.add_argument("--host", default="32", help="GiB of host tier")
    ap.add_argument("--out", default="bench/out/tier-copy.json")
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 max_model_len=max(32768, 2 * args.tokens), max_num_seqs=8,
                                 kv_budget_bytes=int(float(args.kv_budget) * 2**30),
                                 kv_host_bytes=int(float(args.host) * 2**30)))
    report = {"command": "python -m bench.lab.tier_copy " + " ".join(argv or []),
              "device": torch.cuda.get_device_name(0), "block_bytes": engine.block_bytes,
              "copy": copy_rates(engine, args.tokens // engine.block_size)}
    print(json.dumps(report["copy"]), flush=True)
    host = engine.tiers.host  # the copy test's keys go; the prompts' come
    host.settle()
    host.slot_of.clear(), host.key_of.clear(), host.pinned.clear(), host.above.clear()
    host.free = list(range(host.capacity - 1, -1, -1))
    report["ttft"] = ttft(engine, args.tokens, random.Random(0))
    report["tiers"] = engine.tiers.info()
    print(json.dumps(report["ttft"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
