#!/bin/bash
# Tensor-parallel benchmarks on a 2-GPU machine (the device tool's nvidia-h200-x2): all-reduce latency,
# Mistral-7B shape TP=1 vs TP=2, Llama-3-70B shape TP=2 engine decode, and serving through pdserve up --tp 2.
#   OUT=bench/out/tp bash bench/gpu_tp.sh [steps...]   (steps: allreduce mistral llama70b serve; default all)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out/tp}; mkdir -p "$OUT"
PY=${PY:-python3}
steps=${*:-allreduce mistral llama70b serve}
common="--load-format dummy --dtype bfloat16 --batches 1,32 --decode-steps 64 --requests 32 --max-num-seqs 32 --max-model-len 4096"
for step in $steps; do
  case $step in
    allreduce) timeout 200 $PY -m bench.allreduce --gpus 2 --out "$OUT/allreduce" ;;
    mistral)
      timeout 200 $PY -m deploy.cli bench engine --model mistral-7b --tp 1 $common --out "$OUT/mistral-tp1"
      timeout 200 $PY -m deploy.cli bench engine --model mistral-7b --tp 2 $common --out "$OUT/mistral-tp2" ;;
    llama70b) timeout 400 $PY -m deploy.cli bench engine --model llama-3-70b --tp 2 $common --out "$OUT/llama70b-tp2" ;;
    serve)
      $PY -m deploy.cli up --colocated --tp 2 --model llama-3-70b --load-format dummy --dtype bfloat16 \
        --max-model-len 4096 --max-num-seqs 32 --port 8011 --ready-timeout 400 > "$OUT/up.log" 2>&1 &
      up=$!
      for i in $(seq 400); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
      timeout 300 $PY -m deploy.cli bench serve --url http://127.0.0.1:8011 --concurrency 16 --prompt-len 512 \
        --max-tokens 64 --requests 64 --out "$OUT/serve-llama70b-tp2"
      kill -INT $up; wait $up ;;
  esac
done
