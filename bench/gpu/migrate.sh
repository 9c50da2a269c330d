#!/bin/bash
# Moving decoding requests between decode workers on GPUs (bench migrate: undisturbed, then drained mid-way).
#   OUT=bench/out/migrate TAG=2xh100-DATE bash bench/gpu/run.sh migrate [steps...]
# steps (default: drain long):
#   drain  1P2D over nccl on 2 GPUs (each prefill shares a card), 32 live streams of 256 tokens, the busiest decode
#          worker drained: errors, equal texts, the gap p99 against the undisturbed run's, each move's stall
#   long   the same with ~8k-token contexts, 8 streams: the stall of moving an 8k context
#   roles  4 GPUs, bench goodput --workload shifting (prompt-heavy and generation-heavy phases every 60 s) at RATES
#          (default 12,18,24) for DURATION s each (default 150; 120 is one phase of each kind): CONFIGS (default
#          "3p1d 2p2d auto"; also 1p3d, mixed, and auto-plan: --roles-profile PROFILE, default the H200 profile of
#          2026-11-28 calibrated on the 3P1D shifting run, `pdserve plan ... --calibrate --save-profile`) side by side, every worker told the TPOT SLO (15 ms: the mixed
#          workers' step cap, and the decoding pressure --roles auto reads); a configuration takes ~2.5-3 minutes a
#          rate, so give each its own call of one machine; all over nccl. On 4x H200 (2026-11-28) 3P1D held 16
#          req/s (81% at 22) and the planner puts 2P2D below it (plan-4gpu-shifting-phases-2026-11-28-h200.md)
OUT=${OUT:-bench/out/migrate}
TAG=${TAG:-gpu}
source "$(dirname "$0")/common.sh"
export PDSERVE_LOG_LEVEL=${PDSERVE_LOG_LEVEL:-INFO}  # each move's push in the logs beside the tables
PROFILE=${PROFILE:-bench/results/engine-mistral7b-h200-2026-11-28-profile-calibrated-shifting.json}
model="--model mistral-7b --load-format dummy --dtype bfloat16 --max-model-len 9216 --max-num-seqs 64 --kv-budget 8G"
for step in ${*:-drain long}; do
  case $step in
    drain) timeout 580 $PY -m pdserve bench migrate --up-args "--decode 2 --gpus 2 --transport nccl $model" \
             --streams 32 --max-tokens 256 --out "$OUT/migrate-drain-c32-$TAG" 2> "$OUT/migrate-drain-c32-$TAG.log" | tail -8 ;;
    long) timeout 580 $PY -m pdserve bench migrate --up-args "--decode 2 --gpus 2 --transport nccl $model" \
            --streams 8 --max-tokens 256 --prompt-words 2000 --out "$OUT/migrate-drain-8k-$TAG" 2> "$OUT/migrate-drain-8k-$TAG.log" | tail -8 ;;
    roles)
      declare -A cfg=([2p2d]="--prefill 2 --decode 2" [1p3d]="--prefill 1 --decode 3" [3p1d]="--prefill 3 --decode 1"
                      [mixed]="--prefill 0 --decode 0 --mixed 4" [auto]="--prefill 0 --decode 0 --mixed 4 --roles auto"
                      [auto-plan]="--prefill 0 --decode 0 --mixed 4 --roles auto --roles-profile $PROFILE")
      names=${CONFIGS:-3p1d 2p2d auto}; configs=()
      for c in $names; do configs+=(--config "$c=${cfg[$c]} --gpus 4 --transport nccl --slo-tpot-ms 15"); done
      # 40 GiB pools as the goodput runs (bench/gpu/disagg.sh): 8 GiB ones (~14 prompts of the prompt-heavy phase)
      # passed 90% in use with light decode steps, which --roles auto read as decoding pressure
      timeout 580 $PY -m pdserve bench goodput --up-args "${model/--kv-budget 8G/--kv-budget 40G}" --slo-ttft-ms 2000 --slo-tpot-ms 15 \
        --workload shifting --rates "${RATES:-12,18,24}" --duration "${DURATION:-150}" --warmup-requests 10 --ttft-concurrency "" \
        "${configs[@]}" --out "$OUT/goodput-shifting-${names// /-}-$TAG" 2>&1 | tee "$OUT/goodput-shifting-${names// /-}-$TAG.log" |
        grep -v "^  requests" | grep -v "^\[" | tail -12; grep -h "roles \(auto\|plan\):" "$OUT/goodput-shifting-${names// /-}-$TAG.log" | tail -20 ;;
  esac
done
