#!/bin/bash
# FP8 on one GPU (issue 28; one H100 or H200): the Triton/FP8 checks on the GPU, then `pdserve bench fp8`
# (projection GEMMs bf16 vs FP8, decode tok/s with bf16 and FP8 weights, 8k sequences per KV budget, 16 x 8k steps,
# logits agreement) serving with an FP8 KV cache (serve), and
# 1P1D over NCCL with FP8 KV (serve1p1d: two GPUs).
#   OUT=bench/out/fp8 bash bench/gpu/run.sh fp8 [steps...]   (steps: test fp8 serve; serve1p1d needs two GPUs)
OUT=${OUT:-bench/out/fp8}
TAG=${TAG:-h200}
source "$(dirname "$0")/common.sh"
steps=${*:-test fp8 serve}
model="--model mistral-7b --load-format dummy --dtype bfloat16"
source "$(dirname "$0")/serve.sh"  # serve_c32
for step in $steps; do
  case $step in
    test) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_triton_ops.py tests/test_fp8_kv.py \
            tests/test_fp8_weights.py -k "not cluster and not disaggregated and not convert_on_arrival" --tb=line 2>&1 \
            | grep -E "^(E |FAILED|/)|passed|failed" | tail -12 ;;
    fp8) timeout 560 $PY -m pdserve bench fp8 $model --batches 1,8,32,64 --prompt-len 512 --context 8192 \
           --kv-budget 16G --out "$OUT/fp8-mistral7b-$TAG" 2>&1 | grep -v " INFO " | tail -45 ;;
    serve)  # colocated, FP8 weights and FP8 KV
      $PY -m pdserve up --colocated $model --quantization fp8 --kv-cache-dtype fp8 --max-model-len 4096 \
        --max-num-seqs 64 --port 8013 --ready-timeout 300 > "$OUT/up-fp8.log" 2>&1 &
      up=$!
      serve_c32 8013 colocated-fp8
      kill -INT $up; wait $up ;;
    serve1p1d)  # two GPUs: prefill on cuda:0, decode on cuda:1, FP8 KV over NCCL
      $PY -m pdserve up --transport nccl $model --kv-cache-dtype fp8 --max-model-len 4096 --max-num-seqs 64 \
        --port 8014 --ready-timeout 300 > "$OUT/up-1p1d-fp8.log" 2>&1 &
      up=$!
      serve_c32 8014 1p1d-nccl-fp8kv
      kill -INT $up; wait $up ;;
  esac
done
