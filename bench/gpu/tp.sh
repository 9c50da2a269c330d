#!/bin/bash
# Tensor-parallel benchmarks on a 2-GPU machine (2x H100 or 2x H200).
#   OUT=bench/out/tp TAG=2xh100 bash bench/gpu/run.sh tp [steps...]
# steps (default: allreduce mistral llama70b serve):
#   allreduce  NCCL against the one-shot all-reduce inside CUDA graphs
#   mistral    Mistral-7B shape: TP=1, TP=2 (the step ahead) and TP=2 --no-overlap, engine decode, one run
#   llama70b   Llama-3-70B shape TP=2 engine decode
#   serve      pdserve up --colocated --tp 2 (70B) under bench serve, concurrency 16
#   handoff    the 2-GPU tests (TP step ahead through graphs and NCCL, the nccl transport), KV between TP groups of different sizes (bench.tp_handoff, nccl and tcp; nccl pairs on one GPU
#              copy through CUDA IPC) and the nccl transport's same-GPU checks (bench.nccl_check --same-gpu)
#   profile    rank 0's torch profile of Mistral-7B TP=2 decode steps (bench.profile_engine --tp 2)
#   gemv       the batch-1 projection kernel's tiles swept for one TP=2 rank's shapes (Mistral-7B), then Mistral TP=2
#              decode with the picks (PDSERVE_GEMV_CONFIGS) against the built-in tiles, one run
#   pp         PP=2 against TP=2, Llama-3-70B shape, hidden states over nccl (bench pipeline; issue 31's bar)
#   pushed     the GPU tests of the pushed all-reduce, then Mistral-7B TP=1 and TP=2 with batch 1's all-reduces
#              one-shot (oneshot) and pushed by the projections (auto, the default), one run
#   pushed70b  the same A/B for the Llama-3-70B shape (TP=2 only)
#   servetp    Mistral-7B through pdserve up --colocated --tp 2 under bench serve at concurrency 1 and 16, batch 1's
#              all-reduces one-shot and pushed (one cluster each)
OUT=${OUT:-bench/out/tp}
TAG=${TAG:-2xh100}
source "$(dirname "$0")/common.sh"
steps=${*:-allreduce mistral llama70b serve}
common="--load-format dummy --dtype bfloat16 --batches 1,32 --decode-steps 64 --requests 8 --max-num-seqs 32 --max-model-len 4096"
for step in $steps; do
  case $step in
    allreduce) timeout 200 $PY -m bench.lab.allreduce --gpus 2 --out "$OUT/allreduce-$TAG" ;;
    mistral)
      timeout 120 $PY -m pdserve bench engine --model mistral-7b --tp 1 $common --out "$OUT/engine-mistral-tp1-$TAG"
      timeout 150 $PY -m pdserve bench engine --model mistral-7b --tp 2 $common --out "$OUT/engine-mistral-tp2-$TAG"
      timeout 150 $PY -m pdserve bench engine --model mistral-7b --tp 2 --no-overlap $common \
        --out "$OUT/engine-mistral-tp2-no-overlap-$TAG" ;;
    llama70b) timeout 400 $PY -m pdserve bench engine --model llama-3-70b --tp 2 $common --out "$OUT/engine-llama70b-tp2-$TAG" ;;
    serve)
      $PY -m pdserve up --colocated --tp 2 --model llama-3-70b --load-format dummy --dtype bfloat16 \
        --max-model-len 4096 --max-num-seqs 32 --port 8011 --ready-timeout 400 > "$OUT/up.log" 2>&1 &
      up=$!
      for i in $(seq 400); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
      timeout 300 $PY -m pdserve bench serve --url http://127.0.0.1:8011 --concurrency 16 --prompt-len 512 \
        --max-tokens 64 --requests 64 --out "$OUT/serve-llama70b-tp2-$TAG"
      kill -INT $up; wait $up ;;
    handoff)
      timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_tp_overlap.py tests/test_nccl.py \
        -k "gpus" 2>&1 | tail -5
      timeout 200 $PY -m bench.nccl_check --same-gpu --out "$OUT/nccl-check-same-gpu-$TAG.json" | tail -5
      timeout 400 $PY -m bench.tp_handoff --transports nccl,tcp --out "$OUT/tp-handoff-$TAG" ;;
    profile)  # where a TP=2 step's time goes: rank 0's torch profile at batch 1, step times at 1 and 32
      timeout 300 $PY -m bench.profile_engine --model mistral-7b --load-format dummy --dtype bfloat16 --tp 2 \
        --batch 1 --steps 16 --graph-times 1,32 > "$OUT/profile-mistral-tp2-$TAG.txt" 2>&1; tail -30 "$OUT/profile-mistral-tp2-$TAG.txt" ;;
    gemv)
      timeout 420 $PY -m pdserve bench kernels --model mistral-7b --only fused --sweep --tp 2 --out "$OUT/gemv-mistral-tp2-$TAG"
      timeout 150 $PY -m pdserve bench engine --model mistral-7b --tp 2 $common --out "$OUT/engine-mistral-tp2-builtin-$TAG"
      PDSERVE_GEMV_CONFIGS="$OUT/gemv-mistral-tp2-$TAG-picks.json" timeout 150 $PY -m pdserve bench engine \
        --model mistral-7b --tp 2 $common --out "$OUT/engine-mistral-tp2-picks-$TAG" ;;
    pushed)
      timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_pushed.py tests/test_triton_gemv.py --tb=short 2>&1 \
        | grep -E "^(E |FAILED)|passed|failed" | tail -12
      timeout 120 $PY -m pdserve bench engine --model mistral-7b --tp 1 $common --out "$OUT/engine-mistral-tp1-$TAG" \
        2>&1 | grep "decode batch"
      for ar in oneshot auto; do
        PDSERVE_TP_ALLREDUCE=$ar timeout 150 $PY -m pdserve bench engine --model mistral-7b --tp 2 $common \
          --out "$OUT/engine-mistral-tp2-ar-$ar-$TAG" 2>&1 | grep "decode batch\|all-reduce"
      done ;;
    pushed70b)
      for ar in oneshot auto; do
        PDSERVE_TP_ALLREDUCE=$ar timeout 400 $PY -m pdserve bench engine --model llama-3-70b --tp 2 $common \
          --out "$OUT/engine-llama70b-tp2-$ar-$TAG" 2>&1 | grep "decode batch\|all-reduce"
      done ;;
    servetp)
      for ar in oneshot auto; do
        PDSERVE_TP_ALLREDUCE=$ar $PY -m pdserve up --colocated --tp 2 --model mistral-7b --load-format dummy \
          --dtype bfloat16 --max-model-len 4096 --max-num-seqs 32 --port 8015 --ready-timeout 300 > "$OUT/up-tp-$ar.log" 2>&1 &
        up=$!
        for i in $(seq 300); do curl -sf http://127.0.0.1:8015/health > /dev/null && break; sleep 1; done
        for c in 1 16; do
          timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:8015 --concurrency $c --prompt-len 512 \
            --max-tokens 64 --requests $((c == 1 ? 24 : 64)) --seed $c --out "$OUT/serve-mistral-tp2-$ar-c$c-$TAG" \
            2>&1 | grep "^requests"
        done
        kill -INT $up; wait $up
      done ;;
    pp)
      timeout 500 $PY -m pdserve bench pipeline --model llama-3-70b --device cuda:0,cuda:1 --dtype bfloat16 \
        --layouts tp2,pp2 --pp-transport nccl --batch 32 --prompt-len 128 --prefill-len 512 --decode-steps 32 \
        --out "$OUT/pipeline-llama70b-pp2-vs-tp2-$TAG" 2>&1 | tail -14 ;;
  esac
done
