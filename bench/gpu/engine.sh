#!/usr/bin/env bash
# The engine on one GPU: correctness against CPU and HF, `pdserve bench engine` on a random Mistral-7B-shape bf16
# checkpoint, and `pdserve bench serve --concurrency 32` through a colocated `pdserve up`.
# Usage (on the GPU machine, repo root): bash bench/gpu/run.sh engine OUTDIR [engine|serve|all]
set -uo pipefail
OUT=${1:-bench/out/device}; WHAT=${2:-all}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
CKPT=${CKPT:-/tmp/mistral-7b}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f "$CKPT/config.json" ] || python3 -m bench.random_checkpoint --shape mistral-7b --out "$CKPT"
if [ "$WHAT" != serve ]; then
  python3 -m bench.gpu_check --checkpoint "$CKPT" --out "$OUT/gpu_check.json"
  python3 -m pdserve bench engine --model "$CKPT" --dtype bfloat16 --batches 1,8,32,64 --prompt-len 512 \
    --decode-steps 32 --hf --requests 64 --input-len 128:1024 --output-len 32:128 --out "$OUT/engine-mistral7b"
fi
if [ "$WHAT" != engine ]; then
  python3 -m pdserve up --colocated --model "$CKPT" --dtype bfloat16 --port 8000 --ready-timeout 300 &
  UP=$!
  for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
  python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 128 --concurrency 32 --prompt-len 512 \
    --max-tokens 64 --out "$OUT/serve-colocated-c32"
  python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 16 --concurrency 1 --prompt-len 512 \
    --max-tokens 64 --out "$OUT/serve-colocated-c1"
  kill -TERM $UP; wait $UP
fi
