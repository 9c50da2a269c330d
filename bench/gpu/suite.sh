#!/usr/bin/env bash
# The GPU suite in one command: what the machine's GPU count allows of bench.gpu_suite's modes (1 GPU: colocated with
# and without the step ahead, FP8; 2: 1P1D over nccl and tcp, TP=2 colocated, and pdserve deploy ray with a GPU for
# each role where Ray imports; 4: prefill TP=2 -> decode TP=2), after the burst of cached prompts that once hung
# (bench serve c1 x 8, then c32 x 128 over the same prompts). With 2 GPUs or more, clean stops: a 1P1D nccl cluster,
# a bench goodput configuration and bench stream over nccl, whose logs must hold no stack trace; then, side by side,
# bench chaos for CHAOS_S seconds (default 300) on 2P2D over nccl and on two colocated replicas, a worker SIGKILLed
# every 30 s in each (with 2 GPUs three workers share a card: on 80 GB cards give --max-num-seqs 16). The report:
# $OUT/gpu-suite-$TAG.json, chaos-*-$TAG.{json,md}, the bench serve tables and the logs beside them. SKIP_HANG,
# SKIP_SHUTDOWN, SKIP_CHAOS, SKIP_MODES=1 leave a part out; MODES picks modes, CHAOS the chaos runs. The long-context
# case (SKIP_LONG=1 leaves it out): a prompt of LONG tokens (default 100,000), Llama-3.1-8B shape, colocated and 1P1D
# over nccl, then the same prompt again and one over the context: $OUT/gpu-suite-long-$TAG.json.
#   OUT=bench/results TAG=h100-2026-11-27 bash bench/gpu/run.sh suite [MODEL_ARGS...]
set -uo pipefail
OUT=${OUT:-bench/out/gpu-suite}; TAG=${TAG:-gpu}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
model=${*:-"--model mistral-7b --load-format dummy --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64"}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
if [ "${SKIP_HANG:-0}" = 0 ]; then
  port=8123
  $PY -m pdserve up --colocated $model --port $port --ready-timeout 600 > "$OUT/hang-up-$TAG.log" 2>&1 &
  up=$!
  for _ in $(seq 1 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 2; done
  kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/hang-up-$TAG.log"; exit 1; }
  for wave in "1 8" "32 128"; do
    set -- $wave
    timeout 400 $PY -m pdserve bench serve --url http://127.0.0.1:$port --concurrency $1 --requests $2 \
      --prompt-len 512 --max-tokens 64 --out "$OUT/hang-c$1-$TAG" 2>&1 | grep -E "^\||requests|error" | tail -4
  done
  curl -s localhost:$port/metrics | grep -E "^pdserve_requests_stalled_total|^pdserve_requests_total"
  kill -TERM $up; wait $up
fi
if [ "$gpus" -ge 2 ] && [ "${SKIP_SHUTDOWN:-0}" = 0 ]; then  # a clean stop of an nccl pair: no stack traces
  port=8124
  $PY -m pdserve up --transport nccl --gpus 2 $model --port $port --ready-timeout 600 > "$OUT/shutdown-nccl-$TAG.log" 2>&1 &
  up=$!
  for _ in $(seq 1 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 2; done
  served=$(basename "$(echo "$model" | sed -E 's/.*--model ([^ ]+).*/\1/')")
  for i in 1 2 3 4; do curl -s localhost:$port/v1/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$served\", \"prompt\": \"hello $i\", \"max_tokens\": 8}" | head -c 150; echo; done
  kill -TERM $up; wait $up
  $PY -m pdserve bench goodput --config "nccl=--transport nccl --gpus 2 $model" --rates 2 --requests 24 \
    --prompt-len 512 --max-tokens 64 --ready-timeout 600 --out "$OUT/shutdown-goodput-$TAG" \
    > "$OUT/shutdown-goodput-$TAG.log" 2>&1 || echo "bench goodput exited $?"
  $PY -m pdserve bench stream --transport nccl --model tiny-llama --device cuda --prompt-len 512 --rounds 4 \
    --out "$OUT/shutdown-stream-$TAG" > "$OUT/shutdown-stream-$TAG.log" 2>&1 || echo "bench stream exited $?"
  for what in nccl goodput stream; do
    echo "clean stop, $what: $(grep -cE 'Traceback|recvValue failed|should dump|ProcessGroupNCCL.*(error|Error)' \
      "$OUT/shutdown-$what-$TAG.log") lines of stack traces or store errors (log: shutdown-$what-$TAG.log)"
  done
fi
if [ "$gpus" -ge 2 ] && [ "${SKIP_CHAOS:-0}" = 0 ]; then  # kills under load: 2P2D over nccl, 2 colocated replicas
  chaos() { $PY -m pdserve bench chaos --duration "${CHAOS_S:-300}" --kill-every 30 --streams 32 \
    --up-args "$1 --ready-timeout 600 $model" --out "$OUT/chaos-$2-$TAG" > "$OUT/chaos-$2-$TAG.log" 2>&1
    echo "chaos $2 exited $?"; }
  wide=$([ "$gpus" -ge 4 ] && echo 4 || echo 2)  # 2 GPUs: each prefill worker shares its GPU with a decode worker
  for c in ${CHAOS:-2p2d-nccl colocated-x2}; do
    case $c in
      2p2d-nccl) chaos "--prefill 2 --decode 2 --gpus $wide --transport nccl --kv-budget 8G" $c & ;;
      colocated-x2) chaos "--colocated --decode 2 --gpus 2 --kv-budget 8G" $c & ;;
    esac
  done
  wait
  for c in ${CHAOS:-2p2d-nccl colocated-x2}; do
    tail -n +3 "$OUT/chaos-$c-$TAG.md" 2>/dev/null | grep -E "requests|leaked|verdict"
    echo "chaos $c: $(grep -cE 'Traceback|recvValue failed|should dump' "$OUT/chaos-$c-$TAG.log") lines of stack traces"
  done
fi
if [ "${SKIP_LONG:-0}" = 0 ]; then  # a 100k-token prompt colocated and 1P1D over nccl (one GPU: the pair shares it)
  $PY -m bench.gpu_suite --modes colocated,1p1d-nccl --gpus --long ${LONG:-100000} --timeout 300 \
    --out "$OUT/gpu-suite-long-$TAG.json" --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
    --max-model-len 131072 --kv-budget 24G --max-num-seqs 16 || echo "long-context case failed"
fi
[ "${SKIP_MODES:-0}" = 1 ] && exit 0
modes=colocated,colocated-eager,fp8-colocated
[ "$gpus" -ge 2 ] && modes=$modes,1p1d-nccl,1p1d-tcp,tp2-colocated
[ "$gpus" -ge 2 ] && $PY -c "import ray" 2>/dev/null && modes=$modes,ray-1p1d-nccl
[ "$gpus" -ge 4 ] && modes=$modes,tp2-1p1d-nccl
$PY -m bench.gpu_suite --modes "${MODES:-$modes}" --gpus --out "$OUT/gpu-suite-$TAG.json" $model
