#!/usr/bin/env bash
# The GPU suite in one command: what the machine's GPU count allows of bench.gpu_suite's modes (1 GPU: colocated with
# and without the step ahead, FP8; 2: 1P1D over nccl and tcp, TP=2 colocated; 4: prefill TP=2 -> decode TP=2), after
# the burst of cached prompts that once hung (bench serve c1 x 8, then c32 x 128 over the same prompts). The report:
# $OUT/gpu-suite-$TAG.json and the bench serve tables beside it; with 2 GPUs or more, a stop of a 1P1D nccl cluster
# whose log must hold no stack trace. SKIP_HANG, SKIP_SHUTDOWN, SKIP_MODES=1 leave a part out; MODES picks modes.
#   OUT=bench/results TAG=h100-2026-11-27 bash bench/gpu_suite.sh [MODEL_ARGS...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-bench/out/gpu-suite}; TAG=${TAG:-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
model=${*:-"--model mistral-7b --load-format dummy --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64"}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
if [ "${SKIP_HANG:-0}" = 0 ]; then
  port=8123
  $PY -m deploy.cli up --colocated $model --port $port --ready-timeout 600 > "$OUT/hang-up-$TAG.log" 2>&1 &
  up=$!
  for _ in $(seq 1 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 2; done
  kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/hang-up-$TAG.log"; exit 1; }
  for wave in "1 8" "32 128"; do
    set -- $wave
    timeout 400 $PY -m deploy.cli bench serve --url http://127.0.0.1:$port --concurrency $1 --requests $2 \
      --prompt-len 512 --max-tokens 64 --out "$OUT/hang-c$1-$TAG" 2>&1 | grep -E "^\||requests|error" | tail -4
  done
  curl -s localhost:$port/metrics | grep -E "^pdserve_requests_stalled_total|^pdserve_requests_total"
  kill -TERM $up; wait $up
fi
if [ "$gpus" -ge 2 ] && [ "${SKIP_SHUTDOWN:-0}" = 0 ]; then  # a clean stop of an nccl pair: no stack traces
  port=8124
  $PY -m deploy.cli up --transport nccl --gpus 2 $model --port $port --ready-timeout 600 > "$OUT/shutdown-nccl-$TAG.log" 2>&1 &
  up=$!
  for _ in $(seq 1 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 2; done
  served=$(basename "$(echo "$model" | sed -E 's/.*--model ([^ ]+).*/\1/')")
  for i in 1 2 3 4; do curl -s localhost:$port/v1/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$served\", \"prompt\": \"hello $i\", \"max_tokens\": 8}" | head -c 150; echo; done
  kill -TERM $up; wait $up
  echo "nccl shutdown: $(grep -cE 'Traceback|recvValue failed|should dump|ProcessGroupNCCL.*(error|Error)' \
    "$OUT/shutdown-nccl-$TAG.log") lines of stack traces or store errors (log: shutdown-nccl-$TAG.log)"
fi
[ "${SKIP_MODES:-0}" = 1 ] && exit 0
modes=colocated,colocated-eager,fp8-colocated
[ "$gpus" -ge 2 ] && modes=$modes,1p1d-nccl,1p1d-tcp,tp2-colocated
[ "$gpus" -ge 4 ] && modes=$modes,tp2-1p1d-nccl
$PY -m bench.gpu_suite --modes "${MODES:-$modes}" --gpus --out "$OUT/gpu-suite-$TAG.json" $model
