#!/bin/bash
# Mixture-of-experts on one GPU (issue 29; one H100 or H200): the MoE kernel checks on the GPU, engine
# decode for the Qwen3-30B-A3B and Mixtral-8x7B shapes (random bf16 weights made on the GPU), serving Qwen3-30B-A3B
# colocated (serve) and 1P1D over NCCL (serve1p1d: two GPUs).
#   OUT=bench/out/moe bash bench/gpu/run.sh moe [steps...]   (steps: test engine serve; serve1p1d needs two GPUs)
OUT=${OUT:-bench/out/moe}
TAG=${TAG:-h200}
source "$(dirname "$0")/common.sh"
steps=${*:-test engine serve}
qwen="--model qwen3-30b-a3b --load-format dummy --dtype bfloat16"
source "$(dirname "$0")/serve.sh"  # serve_c32
for step in $steps; do
  case $step in
    test) timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_triton_ops.py -k moe --tb=line 2>&1 | tail -3 ;;
    engine)
      timeout 200 $PY -m pdserve bench engine $qwen --batches 1,8,64 --prompt-len 512 --decode-steps 32 --requests 16 \
        --max-num-seqs 64 --max-model-len 4096 --kv-budget 8G --out "$OUT/engine-qwen3-30b-a3b-$TAG" 2>&1 | tail -7
      timeout 280 $PY -m pdserve bench engine --model mixtral-8x7b --load-format dummy --dtype bfloat16 --batches 1,32 \
        --prompt-len 512 --decode-steps 32 --requests 16 --max-num-seqs 32 --max-model-len 4096 --kv-budget 8G \
        --out "$OUT/engine-mixtral-8x7b-$TAG" 2>&1 | tail -6 ;;
    serve)
      $PY -m pdserve up --colocated $qwen --max-model-len 4096 --max-num-seqs 64 --kv-budget 16G --port 8015 \
        --ready-timeout 300 > "$OUT/up-moe.log" 2>&1 &
      up=$!
      serve_c32 8015 colocated-qwen3-30b-a3b
      kill -INT $up; wait $up ;;
    serve1p1d)
      $PY -m pdserve up --transport nccl $qwen --max-model-len 4096 --max-num-seqs 64 --kv-budget 16G --port 8016 \
        --ready-timeout 300 > "$OUT/up-moe-1p1d.log" 2>&1 &
      up=$!
      serve_c32 8016 1p1d-nccl-qwen3-30b-a3b
      kill -INT $up; wait $up ;;
  esac
done
