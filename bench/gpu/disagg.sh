#!/bin/bash
# Conditional disaggregation and the planner (issue 30), Mistral-7B shape (random bf16 weights made on the GPU).
#   OUT=bench/out/disagg bash bench/gpu/run.sh disagg [steps...]
# One GPU: profile (bench engine --profile: the planner's input), cap (one colocated worker under the mixed
#   workload at a fixed Poisson rate, without and with --slo-tpot-ms: ITL p99 and stalls), mixedstep (what a step
#   that decodes 32 rows and takes a 64-512-token prompt chunk costs against the decode step and the chunk alone:
#   bench engine --mixed-chunks, the fixed cost of the issue's bar; fresh chunks and chunks after 4k tokens of their
#   prompt, as a long prompt's later chunks are served).
# Two GPUs: goodput (2 colocated replicas, plain and capped by the TPOT SLO, vs 1P1D vs 1P1D --disagg auto, mid/long/mixed workloads, TTFT <= 2 s,
#   TPOT <= 10 ms), plan (pdserve plan --validate 2 from the profile measured here).
OUT=${OUT:-bench/out/disagg}
TAG=${TAG:-h100}
source "$(dirname "$0")/common.sh"
RATE=${RATE:-2}
steps=${*:-profile cap}
model="--model mistral-7b --load-format dummy --dtype bfloat16 --max-model-len 9216"
slo="--slo-ttft-ms 2000 --slo-tpot-ms 10"
for step in $steps; do
  case $step in
    profile)
      timeout 240 $PY -m pdserve bench engine $model --batches 1,8,32,64 --decode-steps 32 --requests 8 \
        --max-num-seqs 64 --kv-budget 40G --profile --profile-prompts 128,512,2048,8192 \
        --profile-contexts 512,2048,8192 --out "$OUT/engine-mistral7b-$TAG" 2>&1 | grep -v "^decode\|^offline" | tail -20 ;;
    mixedstep)
      for context in 0 4096; do  # fresh chunks, then chunks after 4k tokens of their prompt (a long prompt's later ones)
        timeout 300 $PY -m pdserve bench engine $model --batches 32 --decode-steps 16 --requests 4 --max-num-seqs 64 \
          --kv-budget 40G --mixed-chunks 64,128,256,512 --mixed-rows 32 --mixed-repeats 8 --mixed-context $context \
          --out "$OUT/engine-mixed-step-mistral7b-ctx$context-$TAG" 2>&1 | tail -12
      done ;;
    cap)
      for variant in plain: capped:--slo-tpot-ms=15; do
        name=${variant%%:*}; extra=${variant#*:}
        $PY -m pdserve up --colocated $model --max-num-seqs 64 --kv-budget 40G --port 8020 ${extra/=/ } \
          --ready-timeout 200 > "$OUT/up-$name.log" 2>&1 &
        up=$!
        for i in $(seq 200); do curl -sf http://127.0.0.1:8020/health > /dev/null && break; sleep 1; done
        timeout 120 $PY -m pdserve bench serve --url http://127.0.0.1:8020 --workload mixed --rate $RATE \
          --concurrency 1000 --duration 45 --warmup-requests 5 --slo-ttft-ms 2000 --slo-tpot-ms 15 \
          --out "$OUT/serve-mixed-r$RATE-$name-$TAG" 2>&1 | grep -A12 "^| metric"
        kill -INT $up; wait $up
      done ;;
    goodput)  # every configuration started once; mid, long and mixed against it; distinct prompts per rate
      # WORKLOADS (default mid,long,mixed; one call per workload fits a 10-minute limit), START, PROBES, DURATION
      timeout ${GOODPUT_TIMEOUT:-1500} $PY -m pdserve bench goodput --up-args "$model --max-num-seqs 64" $slo \
        --workload ${WORKLOADS:-mid,long,mixed} --search ${START:-2} --probes ${PROBES:-5} --duration ${DURATION:-15} \
        --warmup-requests 10 --ttft-concurrency "" \
        --config "2x-colocated=--colocated --decode 2 --gpus 2" \
        --config "2x-colocated-capped=--colocated --decode 2 --gpus 2 --slo-tpot-ms 10" --config "1p1d=--transport nccl" \
        --config "1p1d-auto=--transport nccl --disagg auto --slo-tpot-ms 10" --out "$OUT/goodput-${NAME:-$TAG}" 2>&1 \
        | grep -v "^  requests" ;;
    plan)
      $PY -m pdserve plan --profile "$OUT/engine-mistral7b-$TAG-profile.json" --gpus 2 --workload mixed $slo \
        --validate 2 --up-args "$model --max-num-seqs 64" --out "$OUT/plan-mixed-$TAG" ;;
  esac
done
