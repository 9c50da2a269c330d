#!/bin/bash
# Structured outputs on one GPU (issue 33): decode at batch 32 with a JSON schema on every sequence against none, in
# the same run, Mistral-7B shape (random bf16 weights made on the GPU), plus the grammar engines' host costs.
#   OUT=bench/out/guided bash bench/gpu_guided.sh      (needs xgrammar and llguidance wheels carried for python 3.12)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out/guided}; mkdir -p "$OUT"
PY=${PY:-python3}
TAG=${TAG:-h200}
timeout 500 $PY -m pdserve bench guided --model mistral-7b --load-format dummy --dtype bfloat16 --batch 32 \
  --prompt-len 512 --decode-steps 64 --out "$OUT/guided-mistral7b-bs32-$TAG" 2>&1 | tail -12
