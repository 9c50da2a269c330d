"""Write a random-weight checkpoint of a real model's shape (no download), for benchmarks on a GPU machine.

    python -m bench.random_checkpoint --shape mistral-7b --out /tmp/mistral-7b [--dtype bfloat16]

Weights are drawn on the GPU when there is one (a 7B model takes ~20 s), saved as safetensors shards of at most
5 GB with an index, plus the byte tokenizer (ids beyond its 259 decode to nothing)."""
from __future__ import annotations

import argparse
import json
import os
import time

SHAPES = {
    "mistral-7b": ("MistralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         max_position_embeddings=32768, sliding_window=None, rope_theta=1e6)),
    "llama-3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192, rope_theta=5e5)),
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       max_position_embeddings=40960, tie_word_embeddings=True)),
    # a prefill forward of 2,000 tokens takes seconds on a CPU while its 64 MB fp32 KV crosses 10 Gbit/s in ~55 ms
    # multi-turn chat on a CPU: a 2,000-token system prompt costs a few hundred ms to prefill, a turn's suffix little
    "chat-cpu": ("LlamaConfig", dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)),
    "stream-cpu": ("LlamaConfig", dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)),
}


def main(argv=None) -> int:
    import torch
    import transformers
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
    cls, fields = SHAPES[args.shape]
    config = getattr(transformers, cls)(**{**fields, **({"num_hidden_layers": args.layers} if args.layers else {})})
    config.architectures = [cls.replace("Config", "ForCausalLM")]
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

    for name, p in model.named_parameters():
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
