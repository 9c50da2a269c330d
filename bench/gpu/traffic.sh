#!/usr/bin/env bash
# Real traffic and long prompts on one GPU (Llama-3.1-8B shape for prompts, Mistral-7B shape for the planner's
# profile; dummy bf16 weights made on the GPU). Steps (default all):
#   prefill  one prompt of 2k to 124k tokens through the engine at the default step budget, and a 32k prompt at
#            budgets of 4k to 32k tokens (python -m bench.lab.prefix_attention --engine): TFLOP/s, fraction of peak
#   profile  pdserve bench engine --profile: decode at batch 1/8/32/64 x contexts 512 to 32k, every row decoding
#            through every timed step, and prefill by length: the planner's profile
#   replay   the first 250 requests of the Mooncake conversation trace that fit 30k tokens, 16 output tokens each,
#            concurrency 16, one colocated worker, then the same prompts through the engine alone (--engine-alone)
#   long     the GPU suite's long-context case: a 100k prompt colocated and 1P1D over nccl (SKIP_* as in suite.sh)
#   goodput  (2 GPUs) the Azure code and conversation traces and the Mooncake conversation trace replayed at several
#            speeds against one configuration, CONFIG = replicas | 1p1d | 1p1d-auto | "NAME=pdserve up args" (one
#            a call: each takes 6-8 minutes), DURATION trace seconds a window (default 60); the SLOs: TTFT <= 2 s and
#            TPOT <= 25 ms on Azure, TTFT <= 10 s and TPOT <= 50 ms on Mooncake; then
#            pdserve plan --trace T --measured OUT/goodput-*.json for each trace. GOODPUT_TRACES: other
#            TRACE:SPEEDS:TTFT_MS:TPOT_MS entries; GOODPUT_MODEL: other model arguments (the planner's profile's shape)
#   OUT=bench/out/traffic TAG=h200-2026-11-29 TRACES=../shared/traces bash bench/gpu/run.sh traffic [steps...]
set -uo pipefail
OUT=${OUT:-bench/out/traffic}; TAG=${TAG:-gpu}
source "$(dirname "$0")/common.sh"
TRACES=${TRACES:-../shared/traces}
llama="--model llama-3.1-8b --load-format dummy --dtype bfloat16"
for step in ${*:-prefill profile replay long}; do  # goodput: only when named
  case $step in
    prefill)
      $PY -m bench.lab.prefix_attention --engine --lengths 2048,8192,32768,65536,102400,126976 --budgets 8192 \
        --out "$OUT/prefill-lengths-$TAG.json" 2>&1 | grep -v Warning
      $PY -m bench.lab.prefix_attention --engine --lengths 32768 --budgets 4096,16384,32768 \
        --out "$OUT/prefill-budgets-$TAG.json" 2>&1 | grep -v Warning ;;
    profile)
      $PY -m pdserve bench engine --model mistral-7b --load-format dummy --dtype bfloat16 --batches 1,8,32,64 \
        --prompt-len 512 --decode-steps 32 --requests 8 --max-num-seqs 64 --max-model-len 32768 --kv-budget 100G \
        --profile --profile-prompts 512,2048,8192,16384,30000 --profile-contexts 512,2048,4096,8192,32000 \
        --out "$OUT/engine-mistral7b-$TAG" 2>&1 | grep -E "^profile|^decode|^\|" ;;
    replay)
      $PY -m pdserve bench replay "$TRACES/mooncake_conversation.jsonl" --count 250 --max-context 30000 \
        --output-tokens 16 --concurrency 16 --speed inf --engine-alone --ready-timeout 600 \
        --up-args "--colocated $llama --max-model-len 32768" --out "$OUT/replay-conversation-$TAG" 2>&1 \
        | grep -v "^replay\|it/s\]" ;;
    long)
      SKIP_HANG=1 SKIP_SHUTDOWN=1 SKIP_CHAOS=1 SKIP_MODES=1 bash "$(dirname "$0")/suite.sh" ;;
    goodput)
      case ${CONFIG:-1p1d} in
        replicas) name=2x-colocated; up="--colocated --decode 2 --gpus 2" ;;
        1p1d) name=1p1d; up="--transport nccl --gpus 2" ;;
        1p1d-auto) name=1p1d-auto; up="--transport nccl --gpus 2 --disagg auto --slo-tpot-ms 25" ;;
        *=*) name=${CONFIG%%=*}; up=${CONFIG#*=} ;;
      esac
      for t in ${GOODPUT_TRACES:-azure_llm_code_2023.csv:1,2,4,8:2000:25 azure_llm_conv_2023.csv:1,2,4:2000:25 \
               mooncake_conversation.jsonl:0.5,1:10000:50}; do
        IFS=: read -r trace speeds ttft tpot <<< "$t"
        timeout 400 $PY -m pdserve bench replay "$TRACES/$trace" --duration ${DURATION:-60} --speeds $speeds \
          --max-context 32000 --too-long clip --slo-ttft-ms $ttft --slo-tpot-ms $tpot --name $name \
          --up-args "$up ${GOODPUT_MODEL:-$llama} --max-model-len 32768" --out "$OUT/goodput-${trace%%.*}-$name-$TAG" 2>&1 \
          | grep -E "^\| [0-9.]+ \||Fastest"
      done ;;
  esac
done
