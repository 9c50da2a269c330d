#!/bin/bash
# Structured outputs on one GPU (issue 33): decode at batch 32 with a JSON schema on every sequence against none, in
# the same run, Mistral-7B shape (random bf16 weights made on the GPU), plus the grammar engines' host costs.
#   OUT=bench/out/guided bash bench/gpu/run.sh guided      (needs xgrammar and llguidance wheels carried for python 3.12)
OUT=${OUT:-bench/out/guided}
TAG=${TAG:-h200}
source "$(dirname "$0")/common.sh"
timeout 500 $PY -m pdserve bench guided --model mistral-7b --load-format dummy --dtype bfloat16 --batch 32 \
  --prompt-len 512 --decode-steps 64 --out "$OUT/guided-mistral7b-bs32-$TAG" 2>&1 | tail -12
