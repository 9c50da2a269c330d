#!/bin/bash
# Four or eight GPUs of one host (issue 32): xPyD splits vs colocated replicas at equal GPU count, 70B P/D with TP=2
# roles, heterogeneous TP across roles, and pdserve plan's pick against what was measured. Random weights made on
# the GPU.
#   OUT=bench/out/scale TAG=4xh100 [GPUS=4] bash bench/gpu/run.sh scale [steps...]
# GPUS (4 or 8) sizes the mistral, plan and colocated configurations (on 8 the default CONFIGS are colocated 2p6d
#   4p4d 6p2d and their -auto variants) and names the files (goodput-8gpu-...).
# mistral: bench goodput, Mistral-7B shape, on the long and mixed workloads, one `pdserve up` per configuration
#   (CONFIGS picks them: colocated colocated-capped 1p3d 2p2d 3p1d 1p3d-auto 2p2d-auto 3p1d-auto; -capped: steps
#   that decode take only the prompt tokens that keep them within the TPOT SLO), TTFT <= 2 s, TPOT <= 10 ms;
#   rates from START, PROBES of them (bench goodput --search), or RATES (comma-separated, in order).
# llama70b: 1P(TP=2) + 1D(TP=2) over nccl vs two colocated TP=2 replicas (plain and capped; CONFIGS70 picks: 1p1d
#   colocated colocated-capped 1p1d-fp8kv colocated-fp8kv: an FP8 KV cache doubles the pools, which bound 70B on
#   80 GB cards), Llama-3-70B shape
#   (WORKLOADS70, default mixed), TTFT <= 2 s and TPOT <= 25 ms on H200; on H100 the TPOT SLO scales by the two cards' weight-read floors
#   (3.35 vs 4.8 TB/s: 36 ms), since 25 ms is below an H100 pair's bs1 step for 70B (~27 ms measured).
#   Each rate counts at least MIN_TIMED (20) requests after the warm-up ones: a low rate runs longer than DURATION.
# hetero: prefill TP=2 -> two decode TP=1 workers, and two prefill TP=1 -> decode TP=2 (Mistral shape), bench serve
#   c32 over nccl: errors and per-phase wire times.
# hetero8 (8 GPUs, run 4): Llama-3-70B shape, prefill TP=4 -> two decode TP=2 groups and two prefill TP=2 groups ->
#   decode TP=4 over nccl: bench serve c32 (errors, each rank's wire time), then bench.tp_handoff's llama8 part
#   (greedy tokens and logprobs of both layouts held to colocated TP=4 and TP=2).
# stall: why a P/D decode worker falls behind (3P1D stalled whole rates on 2026-11-26 (9630024)): 3P1D under the mixed
#   workload at RATE (12) for 12 s, /health sampled every second (health-*.jsonl: queues, blocks, step times),
#   every worker's stacks dumped (kill -USR1) at 8 s into the up log.
# plan: pdserve plan --gpus 4 on each workload from PROFILE (a bench engine --profile JSON; `profile` makes one on
#   GPU 0), calibrated on and set beside the goodput the mistral step measured (--calibrate --measured; every
#   report in OUT: plan keeps the results of the workload planned): the pick against the best.
OUT=${OUT:-bench/out/scale}
GPUS=${GPUS:-4}
TAG=${TAG:-${GPUS}xgpu}
source "$(dirname "$0")/common.sh"
if [ "$GPUS" = 8 ]; then CONFIGS=${CONFIGS:-colocated 2p6d 4p4d 6p2d 2p6d-auto 4p4d-auto 6p2d-auto}
else CONFIGS=${CONFIGS:-colocated 3p1d 2p2d 2p2d-auto}; fi
WORKLOADS=${WORKLOADS:-long,mixed}
PROBES=${PROBES:-5}
DURATION=${DURATION:-10}
PROFILE=${PROFILE:-$OUT/engine-mistral7b-$TAG-profile.json}
steps=${*:-mistral}
rates="--search ${START:-6} --probes $PROBES"; [ -n "${RATES:-}" ] && rates="--rates $RATES"  # RATES: these, in order
mistral="--model mistral-7b --load-format dummy --dtype bfloat16 --max-model-len 9216"
llama="--model llama-3-70b --load-format dummy --dtype bfloat16 --max-model-len 8704"

config() {  # NAME -> "NAME=pdserve up arguments" on GPUS GPUs
  case $1 in
    colocated) echo "${GPUS}x-colocated=--colocated --decode $GPUS --gpus $GPUS" ;;
    colocated-capped) echo "${GPUS}x-colocated-capped=--colocated --decode $GPUS --gpus $GPUS --slo-tpot-ms 10" ;;
    *p*d*)
      x=${1%%p*}; rest=${1#*p}; y=${rest%%d*}
      extra=""; [[ $1 == *-auto ]] && extra=" --disagg auto --slo-tpot-ms 10"
      echo "${x}P${y}D${1#*d}=--prefill $x --decode $y --gpus $GPUS --transport nccl$extra" ;;
  esac
}

config70() {  # NAME TPOT -> "NAME=pdserve up arguments": TP=2 roles or replicas on 4 GPUs
  case $1 in
    1p1d) echo "1P1D-tp2=--prefill-tp 2 --decode-tp 2 --gpus 4 --transport nccl" ;;
    1p1d-fp8kv) echo "1P1D-tp2-fp8kv=--prefill-tp 2 --decode-tp 2 --gpus 4 --transport nccl --kv-cache-dtype fp8" ;;
    colocated-fp8kv) echo "2x-colocated-tp2-fp8kv=--colocated --decode 2 --tp 2 --gpus 4 --kv-cache-dtype fp8" ;;
    colocated) echo "2x-colocated-tp2=--colocated --decode 2 --tp 2 --gpus 4" ;;
    colocated-capped) echo "2x-colocated-tp2-capped=--colocated --decode 2 --tp 2 --gpus 4 --slo-tpot-ms $2" ;;
  esac
}

for step in $steps; do
  case $step in
    profile)
      CUDA_VISIBLE_DEVICES=0 timeout 240 $PY -m pdserve bench engine $mistral --batches 1,8,32,64 \
        --decode-steps 32 --requests 8 --max-num-seqs 64 --kv-budget 40G --profile --profile-prompts 128,512,2048,8192 \
        --profile-contexts 512,2048,8192 --out "$OUT/engine-mistral7b-$TAG" 2>&1 | tail -5 ;;
    mistral)
      args=(); for c in $CONFIGS; do args+=(--config "$(config "$c")"); done
      timeout ${GOODPUT_TIMEOUT:-1500} $PY -m pdserve bench goodput --up-args "$mistral --max-num-seqs 64" \
        --slo-ttft-ms 2000 --slo-tpot-ms 10 --workload "$WORKLOADS" $rates \
        --duration $DURATION --warmup-requests 10 --min-timed ${MIN_TIMED:-20} --ttft-concurrency "" "${args[@]}" \
        --out "$OUT/goodput-${GPUS}gpu-mistral-${NAME:-$TAG}" 2>&1 | grep -v "^  requests" ;;
    llama70b)
      tpot=25; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H100 && tpot=36
      args=(); for c in ${CONFIGS70:-1p1d colocated colocated-capped}; do args+=(--config "$(config70 "$c" $tpot)"); done
      timeout ${GOODPUT_TIMEOUT:-1500} $PY -m pdserve bench goodput --up-args "$llama --max-num-seqs 32" \
        --slo-ttft-ms 2000 --slo-tpot-ms $tpot --workload "${WORKLOADS70:-mixed}" --search ${START70:-0.5} \
        --probes $PROBES --duration ${DURATION70:-25} --warmup-requests 4 --min-timed ${MIN_TIMED:-20} --ttft-concurrency "" \
        "${args[@]}" --out "$OUT/goodput-4gpu-llama70b-tp2-${NAME:-$TAG}" 2>&1 | grep -v "^  requests" ;;
    hetero)
      for layout in "p-tp2-to-2d=--prefill 1 --prefill-tp 2 --decode 2" "2p-to-d-tp2=--prefill 2 --decode 1 --decode-tp 2"; do
        name=${layout%%=*}
        $PY -m pdserve up ${layout#*=} --gpus 4 --transport nccl $mistral --max-num-seqs 64 --port 8040 \
          --ready-timeout 300 > "$OUT/up-$name.log" 2>&1 &
        up=$!
        for i in $(seq 300); do curl -sf http://127.0.0.1:8040/health > /dev/null && break; sleep 1; done
        timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:8040 --concurrency 32 --requests 96 \
          --prompt-len 512:4096 --max-tokens 32:128 --warmup-requests 8 --out "$OUT/serve-hetero-$name-$TAG" \
          2>&1 | grep -v "^  requests" | tail -22
        kill -INT $up; wait $up
      done ;;
    hetero8)
      for layout in "p-tp4-to-2d-tp2=--prefill 1 --prefill-tp 4 --decode 2 --decode-tp 2" \
                    "2p-tp2-to-d-tp4=--prefill 2 --prefill-tp 2 --decode 1 --decode-tp 4"; do
        name=${layout%%=*}
        $PY -m pdserve up ${layout#*=} --gpus 8 --transport nccl $llama --max-num-seqs 32 --port 8042 \
          --ready-timeout 500 > "$OUT/up-hetero8-$name.log" 2>&1 &
        up=$!
        for i in $(seq 500); do curl -sf http://127.0.0.1:8042/health > /dev/null && break
          kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/up-hetero8-$name.log"; break; }; sleep 1; done
        timeout 300 $PY -m pdserve bench serve --url http://127.0.0.1:8042 --concurrency 32 --requests 96 \
          --prompt-len 512:4096 --max-tokens 32:128 --warmup-requests 8 --out "$OUT/serve-hetero8-llama70b-$name-$TAG" \
          2>&1 | grep -v "^  requests" | tail -22
        kill -INT $up; wait $up
      done
      timeout 1500 $PY -m bench.tp_handoff --skip tiny,mistral --transports nccl --out "$OUT/tp-handoff-llama70b-$TAG" \
        2>&1 | tail -3 ;;
    stall)
      PDSERVE_LOG_LEVEL=INFO $PY -m pdserve up --prefill 3 --decode 1 --gpus 4 --transport nccl $mistral \
        --max-num-seqs 64 --port 8041 --ready-timeout 300 > "$OUT/up-stall-$TAG.log" 2>&1 &
      up=$!
      for i in $(seq 300); do curl -sf http://127.0.0.1:8041/health > /dev/null && break; sleep 1; done
      timeout 120 $PY -m pdserve bench serve --url http://127.0.0.1:8041 --workload mixed --rate ${RATE:-12} \
        --duration 12 --concurrency 1000 --slo-ttft-ms 2000 --slo-tpot-ms 10 --out "$OUT/serve-stall-$TAG" \
        > "$OUT/serve-stall-$TAG.log" 2>&1 &
      load=$!
      for i in $(seq 40); do
        echo "{\"t\": $i, \"health\": $(curl -s -m 2 http://127.0.0.1:8041/health || echo null)}" >> "$OUT/health-stall-$TAG.jsonl"
        [ $i = 8 ] && pkill -USR1 -f "m deploy[.]cli .*(prefill|decode)"
        kill -0 $load 2> /dev/null || break
        sleep 1
      done
      wait $load; tail -12 "$OUT/serve-stall-$TAG.log"
      kill -INT $up; wait $up ;;
    plan)
      for w in ${WORKLOADS//,/ }; do
        measured=(); for f in "$OUT"/goodput-${GPUS}gpu-mistral-*.json; do [ -f "$f" ] && measured+=(--measured "$f"); done
        calibrate=(); [ ${#measured[@]} -gt 0 ] && calibrate=(--calibrate)
        $PY -m pdserve plan --profile "$PROFILE" --gpus $GPUS --workload $w --slo-ttft-ms 2000 --slo-tpot-ms 10 "${measured[@]}" \
          "${calibrate[@]}" --out "$OUT/plan-${GPUS}gpu-$w-$TAG" | tail -16
      done ;;
  esac
done
