#!/usr/bin/env bash
# Two GPUs, KV over NCCL between the engines' pools: the transport's checks and speed (bench.nccl_check), tiny-model
# end to end against in-process generation (bench.nccl_e2e), and `pdserve bench serve --concurrency 32` through a
# 1P1D nccl `pdserve up` on a random Mistral-7B-shape bf16 checkpoint.
# Usage (on the GPU machine, repo root): bash bench/gpu/run.sh nccl OUTDIR [check|e2e|serve|all]
set -uo pipefail
OUT=${1:-bench/out/device-nccl}; WHAT=${2:-all}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
CKPT=${CKPT:-/tmp/mistral-7b}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
case "$WHAT" in all|check) python3 -m bench.nccl_check --out "$OUT/nccl_check.json" > "$OUT/nccl_check.log" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('checks ok:', all(r['checks'].values()), {k: round(v['pct_of_raw']) for k, v in r['payloads'].items()})" "$OUT/nccl_check.json";; esac
case "$WHAT" in all|e2e) python3 -m bench.nccl_e2e --out "$OUT/nccl_e2e.json" > "$OUT/nccl_e2e.log" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('e2e all equal:', r['all_equal'], 'from blocks', r['prefill'].get('kv_from_blocks'), 'landed', r['decode'].get('kv_landed_in_blocks'))" "$OUT/nccl_e2e.json";; esac
case "$WHAT" in all|serve)
  [ -f "$CKPT/config.json" ] || python3 -m bench.random_checkpoint --shape mistral-7b --out "$CKPT"
  python3 -m pdserve up --transport nccl --model "$CKPT" --dtype bfloat16 --port 8000 --ready-timeout 300 ${UP_ARGS:-} > "$OUT/up.log" 2>&1 &
  UP=$!
  for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
  for run in 1 2; do  # the second run sees pools already churned by the first
    python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 128 --concurrency 32 --prompt-len 512 \
      --max-tokens 64 --out "$OUT/serve-1p1d-nccl-c32-run$run"
  done
  curl -s localhost:8000/health > "$OUT/health.json"
  kill -TERM $UP; wait $UP;;
esac
