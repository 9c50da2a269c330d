#!/usr/bin/env bash
# KV tiers on one GPU (Llama-3.1-8B shape, dummy bf16 weights). Steps (default all):
#   test     the tier's GPU test: evictions, writes ahead and loads through pinned memory, bit-exact
#   copy     the host tier's block copies against the pinned copy limit, and a 16k prefix from host memory
#            against computing it (python -m bench.lab.tier_copy): bars 80% of pinned, TTFT ratio <= 0.15
#   replay   the first 60 requests of the conversation trace that fit 30k tokens, replayed twice with
#            --kv-budget 16G, without and with a 64G host tier: the second pass's reuse (bar 90%) and wall time
#            (bar: 3x sooner with the tier)
#   fetch    a 16k-token prefix the prefill worker holds, fetched by the decode worker over nccl (its own pool
#            let it go), against computing it (python -m bench.lab.prefix_fetch; 1P1D: two GPUs where there
#            are, else the pair shares one): bar 5x faster
#   suite    the GPU suite's cases on a colocated worker with a small pool and a host tier (traffic that returns to
#            evicted prefixes), then bench chaos on it for CHAOS_S seconds (default 120), a worker killed every 30 s
#   chaos    that chaos run alone
#   OUT=bench/out/tiers TAG=h200-DATE TRACES=../shared/traces bash bench/gpu/run.sh tiers [steps...]
set -uo pipefail
OUT=${OUT:-bench/out/tiers}; TAG=${TAG:-gpu}
source "$(dirname "$0")/common.sh"
TRACES=${TRACES:-../shared/traces}
llama="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 32768"
for step in ${*:-test copy replay fetch suite}; do  # chaos: the suite's second half alone
  case $step in
    test)
      timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_host_tier.py -k gpu 2>&1 | tail -2 ;;
    copy)
      $PY -m bench.lab.tier_copy --tokens 16384 --out "$OUT/tier-copy-$TAG.json" 2>&1 | grep -v Warning ;;
    replay)
      for tier in none: host:--kv-host-bytes=64G; do
        name=${tier%%:*}; extra=${tier#*:}
        timeout 500 $PY -m pdserve bench replay "$TRACES/mooncake_conversation.jsonl" --count 60 --max-context 30000 \
          --output-tokens 16 --concurrency 16 --speeds 1000,1000 --same-prompts --ready-timeout 600 \
          --up-args "--colocated $llama --kv-budget 16G ${extra/=/ }" --out "$OUT/replay-twice-$name-$TAG" \
          > "$OUT/replay-twice-$name-$TAG.log" 2>&1
        echo "$name: exited $?"; grep -E "^\| [0-9.]+ \|" "$OUT/replay-twice-$name-$TAG.log"
      done ;;
    fetch)
      gpus=$([ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && echo 2 || echo 1)
      $PY -m bench.lab.prefix_fetch --tokens 16384 --up-args "--transport nccl --gpus $gpus $llama --kv-budget 4G" \
        --out "$OUT/prefix-fetch-$TAG.json" 2>&1 | tee "$OUT/prefix-fetch-$TAG.log" | grep -E '"(cold|fetched)_(first|second)_token_median_s"|speedup|kv_bytes|gpu"' ;;
    suite|chaos)
      up="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 8192 --kv-budget 2G --kv-host-bytes 32G"
      [ $step = suite ] && $PY -m bench.gpu_suite --modes colocated --out "$OUT/gpu-suite-tiers-$TAG.json" $up
      # chaos with a host tier of 4G (2,048 blocks): the router's key sets for a worker's tiers are bounded by them and
      # fill within the warm-up, so the RSS check sees leaks, not a cache filling (with 32G they filled through the
      # whole run: +7.7% router RSS, bench/results/chaos-tiers-32g-h200-2026-12-01-87db3e6.md)
      $PY -m pdserve bench chaos --duration "${CHAOS_S:-120}" --kill-every 30 --streams 16 \
        --up-args "--colocated --decode 2 --gpus 1 ${up/--kv-host-bytes 32G/--kv-host-bytes 4G}" \
        --out "$OUT/chaos-tiers-$TAG" > "$OUT/chaos-tiers-$TAG.log" 2>&1
      echo "chaos exited $?"; tail -n +3 "$OUT/chaos-tiers-$TAG.md" 2>/dev/null | grep -E "requests|leaked|verdict" ;;
  esac
done
