"""Write a random-weight checkpoint of a real model's shape (no download), for benchmarks on a GPU machine.

    python -m bench.random_checkpoint --shape mistral-7b --out /tmp/mistral-7b [--dtype bfloat16]

Weights are drawn on the GPU when there is one (a 7B model takes ~20 s), saved as safetensors shards of at most
5 GB with an index, plus the byte tokenizer (ids beyond its 259 decode to nothing)."""
from __future__ import annotations

import argparse
import json
import os
import time

from engine.models.presets import SHAPES, preset_config

from deploy.progress import bar


def main(argv=None) -> int:
    import torch
    from safetensors.torch import save_file

    from engine.models import build
    from engine.tokenizer import save_byte_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mistral-7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    config = preset_config(args.shape, {"num_hidden_layers": args.layers} if args.layers else None)
    dtype = getattr(torch, args.dtype)
    config.dtype = dtype
    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)
    with torch.device("meta"):
        model = build(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shard, shards, size, weight_map = {}, [], 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, os.path.join(args.out, name))
            shards.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    params = list(model.named_parameters())
    for name, p in bar(len(params), "tensors", "tensor", items=params):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=dtype)
        else:
            t = (torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * args.std).to(dtype).cpu()
        if size + t.numel() * t.element_size() > 5e9:
            flush()
        shard[name] = t
        size += t.numel() * t.element_size()
    flush()
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    save_byte_tokenizer(args.out, config.vocab_size)
    print(f"wrote {args.shape} ({len(weight_map)} tensors, {len(shards)} shards) to {args.out} "
          f"in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
