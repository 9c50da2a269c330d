#!/bin/bash
# Decode-speed benchmarks on one GPU (issue 27; one H100 or H200): kernels with a decode-attention
# sweep, engine decode at batch 1/32/64 and 16 x 8k, serving through pdserve up (c1, c32, c64; a cold first
# wave then a warm second one), and the router's own token rate.
#   OUT=bench/out/decode bash bench/gpu/run.sh decode [steps...]   (steps: test kernels engine serve router; fused:
#   the batch-1 projection kernel's sweep; fewrow: the few-row GEMM's sweep, whose picks engine uses; chat:
#   multi-turn conversations (cached prefixes); rows: whole decode steps over rows of unequal contexts, as serving
#   has (ROWS: the cases); serve1p1d needs two GPUs: UP1P1D adds `pdserve up` arguments, NAME1P1D names them in the
#   files, REQUESTS per wave, default 384: 12 per stream, so the start-up burst weighs on few)
OUT=${OUT:-bench/out/decode}
TAG=${TAG:-h200}
source "$(dirname "$0")/common.sh"
steps=${*:-test kernels engine serve router}
model="--model mistral-7b --load-format dummy --dtype bfloat16"
for step in $steps; do
  case $step in
    test) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_triton_ops.py \
            ${TESTS:-tests/test_overlap.py tests/test_prompt_graphs.py} 2>&1 | tail -3 ;;
    kernels) timeout 420 $PY -m pdserve bench kernels --model mistral-7b ${SWEEP:-} --out "$OUT/kernels-$TAG" 2>&1 \
               | grep -v "^decode attention:" | tail -60 ;;
    engine) fpicks="$OUT/kernels-fewrow-$TAG-picks.json"; [ -f "$fpicks" ] && export PDSERVE_FEWROW_CONFIGS=$fpicks
      timeout 300 $PY -m pdserve bench engine $model --batches 1,32,64 --prompt-len 512 --decode-steps 64 \
              --requests 64 --max-num-seqs 64 --max-model-len 4096 --out "$OUT/engine-$TAG" 2>&1 | tail -12 ;;
    serve)
      $PY -m pdserve up --colocated $model --max-model-len 4096 --max-num-seqs 64 --port 8011 \
        --ready-timeout 300 > "$OUT/up.log" 2>&1 &
      up=$!
      for i in $(seq 300); do curl -sf http://127.0.0.1:8011/health > /dev/null && break
        kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/up.log"; break; }; sleep 1; done
      # first: the first wave after start-up; second: new prompts; repeat: the first's prompts again, cached where
      # the pool still holds them (what a second run of the same command measures). Seeds differ per concurrency:
      # the same seed makes the same prompts, and a later level's "fresh" waves would hit an earlier level's cache
      # (2026-11-25, be76c76 found c64's 4,419 / 4,695 tok/s were such: 3,291 / 3,190 when fresh)
      for c in ${CONCURRENCY:-32 1 64}; do
        n=$(( c == 1 ? 16 : 4 * c ))
        for wave in first:$((c * 10)) second:$((c * 10 + 1)) repeat:$((c * 10)); do
          touch /tmp/wave-mark
          echo "c$c ${wave%:*}: Triton kernels compiled so far: $(ls ~/.triton/cache 2>/dev/null | wc -l)"
          timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:8011 --concurrency $c --prompt-len 512 \
            --max-tokens 64 --requests $n --seed ${wave#*:} --out "$OUT/serve-c$c-${wave%:*}-$TAG" 2>&1 | grep "^requests"
          find ~/.triton/cache -newer /tmp/wave-mark -name "*.json" 2>/dev/null | xargs -r -n1 basename | sed 's/^/  compiled during the wave: /'
        done
      done
      kill -INT $up; wait $up ;;
    chat)  # multi-turn chat through pdserve up: each turn's history is in the prefix cache (TTFT of a cached prefix)
      $PY -m pdserve up --colocated $model --max-model-len 8192 --max-num-seqs 64 --port 8013 \
        --ready-timeout 300 > "$OUT/up-chat.log" 2>&1 &
      up=$!
      for i in $(seq 300); do curl -sf http://127.0.0.1:8013/health > /dev/null && break
        kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/up-chat.log"; break; }; sleep 1; done
      for c in ${CONVERSATIONS:-1 4}; do
        timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:8013 --conversations $c --turns 8 \
          --system-len 2000 --max-tokens 32 --seed $c --out "$OUT/serve-chat-c$c-$TAG" 2>&1 | grep "^requests"
        grep -A1 "ttft" "$OUT/serve-chat-c$c-$TAG.md" | head -2
      done
      kill -INT $up; wait $up ;;
    fused)  # the batch-1 projection kernel (triton_gemv) checked, then timed against the launches it replaces,
            # with a sweep of its tiles whose picks the engine step uses
      timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py tests/test_triton_ops.py --tb=short 2>&1 \
        | grep -E "^(E |FAILED)|passed|failed" | tail -15
      timeout 420 $PY -m pdserve bench kernels --model mistral-7b --only fused --sweep \
        --out "$OUT/kernels-fused-$TAG" > "$OUT/kernels-fused-$TAG.log" 2>&1; grep -A20 "^## Batch-1" "$OUT/kernels-fused-$TAG.md" \
        || tail -20 "$OUT/kernels-fused-$TAG.log" ;;
    fewrow)  # the few-row GEMM (triton_fewrow, bf16 at 16-64 rows, FP8 at 1-32) checked, then its tiles and K
             # splits swept against cuBLAS / the FP8 tile held before; the engine step uses the picks
      timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_triton_fewrow.py tests/test_triton_ops.py \
        tests/test_fp8_weights.py --tb=short 2>&1 | grep -E "^(E |FAILED)|passed|failed" | tail -15
      timeout 540 $PY -m pdserve bench kernels --model mistral-7b --only fewrow \
        --out "$OUT/kernels-fewrow-$TAG" > "$OUT/kernels-fewrow-$TAG.log" 2>&1; grep -A30 "^## Few-row" \
        "$OUT/kernels-fewrow-$TAG.md" || tail -20 "$OUT/kernels-fewrow-$TAG.log" ;;
    rows)  # serving-like decode steps (rows of unequal contexts) beside equal ones: replay, its attention and the
           # rest against (weights + K/V) / copy bandwidth
      name=kernels-rows-$TAG
      timeout 300 $PY -m pdserve bench kernels --model mistral-7b --only steps \
        --step-cases ${ROWS:-1x512,13x3200,13x2000-4400,16x1000-5400,32x512,32x3200} --out "$OUT/$name" > "$OUT/$name.log" 2>&1
      grep -A16 "^## Whole" "$OUT/$name.md" || tail -20 "$OUT/$name.log" ;;
    router)  # paced like engines (5 ms steps) below and above one core's capacity, then as fast as the worker can
      timeout 100 $PY -m pdserve bench router --clients 4 --streams 32 --step-ms 5 --out "$OUT/router-128x5ms-$TAG" 2>&1 | tail -1
      timeout 100 $PY -m pdserve bench router --clients 8 --streams 64 --step-ms 5 --out "$OUT/router-512x5ms-$TAG" 2>&1 | tail -1
      timeout 100 $PY -m pdserve bench router --clients 4 --streams 32 --step-ms 0 --out "$OUT/router-128x0ms-$TAG" 2>&1 | tail -1 ;;
    serve1p1d)  # two GPUs: prefill on cuda:0, decode on cuda:1, KV over NCCL
      $PY -m pdserve up --transport nccl $model --max-model-len 4096 --max-num-seqs 64 --port 8012 \
        --ready-timeout 300 ${UP1P1D:-} > "$OUT/up-1p1d${NAME1P1D:-}.log" 2>&1 &
      up=$!
      for i in $(seq 300); do curl -sf http://127.0.0.1:8012/health > /dev/null && break
        kill -0 $up 2>/dev/null || { echo "pdserve up exited:"; tail -5 "$OUT/up-1p1d${NAME1P1D:-}.log"; break; }; sleep 1; done
      for wave in first:0 second:1; do
        # with each worker's steps over the wave and how busy they kept it
        timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:8012 --concurrency 32 --prompt-len 512 \
          --max-tokens 64 --requests ${REQUESTS:-384} --seed ${wave#*:} \
          --out "$OUT/serve-1p1d-nccl${NAME1P1D:-}-c32-${wave%:*}-$TAG" 2>&1 | grep -E "^requests|^- (prefill|decode)"
      done
      kill -INT $up; wait $up ;;
  esac
done
