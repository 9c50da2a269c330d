#!/bin/bash
# Pipeline parallelism on CUDA (issue 31), on one GPU: two stages sharing it (--device cuda:0,cuda:0) against one
# process, Llama-3-8B shape (random bf16 weights made on the GPU), hidden states over shm and tcp: greedy tokens
# equal to one process's, each hop's phases. A check of the CUDA path (stage_forward with the Triton kernels, pools
# per stage, hops from and to device memory), not a speed-up: two stages on one GPU run one after the other.
#   OUT=bench/out/pp bash bench/gpu/run.sh pp
OUT=${OUT:-bench/out/pp}
TAG=${TAG:-h100}
source "$(dirname "$0")/common.sh"
timeout 200 $PY -m pdserve bench pipeline --model llama-3-8b --device cuda:0,cuda:0 --dtype bfloat16 \
  --layouts single,pp2 --pp-transport shm --batch 32 --prompt-len 256 --prefill-len 2048 \
  --decode-steps 32 --out "$OUT/pipeline-llama8b-1gpu-shm-$TAG" 2>&1 | tail -14
for dtype in float32 bfloat16; do  # fp32: the split itself adds no error beyond the dtype's rounding
  timeout 150 $PY -m pdserve bench pipeline --model qwen3-0.6b --device cuda:0,cuda:0 --dtype $dtype \
    --layouts single,pp2 --pp-transport tcp --batch 32 --prompt-len 256 --prefill-len 2048 \
    --decode-steps 32 --out "$OUT/pipeline-qwen3-0.6b-1gpu-$dtype-$TAG" 2>&1 | tail -14
done
