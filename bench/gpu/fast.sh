#!/usr/bin/env bash
# The GPU fast path (Triton kernels + CUDA graphs for decode) on one GPU: kernels against the torch operations,
# CUDA == CPU tokens (tiny fp32) and Mistral-7B-shape bf16 against HF, `pdserve bench engine` with and without
# graphs and HF eager batched in the same run, `pdserve bench serve` (c32, c1) through a colocated `pdserve up`, and the
# attention kernel candidates side by side (bench.lab.attention_choice).
# Usage (on the GPU machine, repo root): bash bench/gpu/run.sh fast OUTDIR [check|engine|serve|attn|all]
set -uo pipefail
OUT=${1:-bench/out/device-fast}; WHAT=${2:-all}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
CKPT=${CKPT:-/tmp/mistral-7b}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f "$CKPT/config.json" ] || python3 -m bench.random_checkpoint --shape mistral-7b --out "$CKPT"
case "$WHAT" in all|check)
  python3 -m pytest -q -p no:cacheprovider tests/test_triton_ops.py 2>&1 | tail -3
  python3 -m bench.gpu_check --checkpoint "$CKPT" --out "$OUT/gpu_check.json" 2>&1 | grep -v Warning | tail -20;; esac
case "$WHAT" in all|attn)
  python3 -m bench.lab.attention_choice --out "$OUT/attention-choice" 2>&1 | grep -E "^decode|^prefill|flashinfer";; esac
case "$WHAT" in all|engine)
  python3 -m pdserve --log-level INFO bench engine --model "$CKPT" --dtype bfloat16 --batches 1,8,32,64 \
    --prompt-len 512 --decode-steps 32 --hf --compare-eager --requests 64 --input-len 128:1024 --output-len 32:128 \
    --out "$OUT/engine-mistral7b" 2>&1 | grep -E "captured|decode batch|HF eager|offline|\|" ;; esac
case "$WHAT" in all|serve)
  python3 -m pdserve up --colocated --model "$CKPT" --dtype bfloat16 --port 8000 --ready-timeout 300 > "$OUT/up.log" 2>&1 &
  UP=$!
  for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
  python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 128 --concurrency 32 --prompt-len 512 \
    --max-tokens 64 --out "$OUT/serve-colocated-c32" 2>&1 | grep -E "^\||requests 128"
  python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 16 --concurrency 1 --prompt-len 512 \
    --max-tokens 64 --out "$OUT/serve-colocated-c1" 2>&1 | grep -E "^\||requests 16"
  kill -TERM $UP; wait $UP;;
esac
