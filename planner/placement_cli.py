"""``pdserve plan placement``: print (and write as JSON) the layers each node holds (``placement``)."""
from __future__ import annotations

import json
import os

from .placement import (PlacementError, Node, Shape, bytes_per_weight, model_config, place_stage_zero, table,
                        weights_only)


def add_arguments(p):
    p.add_argument("--nodes", required=True, help="name:memGB[:speed],... in pipeline order")
    p.add_argument("--model", required=True, help="a checkpoint directory or a shape name (mistral-7b, "
                   "llama-3-70b, minimax-m2-230b, ...)")
    p.add_argument("--max-model-len", type=int, required=True, help="context every sequence may reach")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences at that context at once")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "fp8"], default="bfloat16")
    p.add_argument("--bits", type=int, default=None, help="quantized weights: bits per weight (group scales added)")
    p.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per KV element (1 for an FP8 cache)")
    p.add_argument("--usable", type=float, default=None, help="share of each node's memory the model may use "
                   "(default: what macOS lets Metal wire, ~0.67 at 36 GB or less, 0.75 above; 0.9 for GPUs)")
    p.add_argument("--reserve-gb", type=float, default=2.0, help="kept free on every node (activations, runtime)")
    p.add_argument("--json", default=None, help="also write the plan here")


def run(args) -> int:
    try:
        nodes = [Node.parse(n) for n in args.nodes.split(",") if n]
        shape = Shape.of(model_config(args.model), bytes_per_weight(args.dtype, args.bits), args.kv_bytes)
        tokens = args.max_model_len * args.max_num_seqs
        naive = weights_only(nodes, shape, tokens, args.usable, args.reserve_gb)
        stages = place_stage_zero(nodes, shape, tokens, args.usable, args.reserve_gb)
    except PlacementError as e:
        print(f"error: {e}")
        return 2
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}")
        return 2
    print(f"{args.model}: {shape.layers} layers, weights {shape.weight_bytes / 1e9:.1f} GB, KV "
          f"{shape.layers * shape.kv_bytes_per_token_layer / 1024:.0f} KiB a token; {args.max_num_seqs} x "
          f"{args.max_model_len:,} tokens\n")
    if stages[0].node is not nodes[0]:
        print(f"stage 0 (which also holds the embedding and the LM head, and samples) is {stages[0].node.name}: "
              f"the order given does not fit\n")
    print(table(stages))
    print("\nby weights alone (layers in proportion to memory, no room kept for the KV):\n")
    print(table(naive))
    short = [s for s in naive if not s.fits]
    if short:
        print("\n" + "; ".join(f"{s.node.name} runs out of memory at {s.max_tokens:,} tokens" for s in short))
    layers = ",".join(str(s.layers) for s in stages)
    print(f"\nlayers per stage: {layers}  (pdserve up --pp {len(stages)} --pp-layers {layers})")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": tokens,
                       "stages": [{"node": s.node.name, "first": s.first, "last": s.last, "weights_gb": s.weights_gb,
                                   "kv_gb": s.kv_gb, "capacity_gb": s.capacity_gb, "fits": s.fits,
                                   "max_tokens": s.max_tokens} for s in stages],
                       "weights_only": [{"node": s.node.name, "layers": s.layers, "fits": s.fits,
                                         "max_tokens": s.max_tokens} for s in naive]}, f, indent=1)
    return 0
