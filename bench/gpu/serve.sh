#!/bin/bash
# Sourced by the bench/gpu_*.sh scripts: serve_c32 PORT NAME waits for a pdserve at 127.0.0.1:PORT to be healthy,
# then runs two waves of `pdserve bench serve` (128 requests, 512-token prompts, 64 tokens out, concurrency 32; the
# second with new prompts) into $OUT/serve-NAME-c32-{first,second}-$TAG.
serve_c32() {
  for i in $(seq 300); do curl -sf http://127.0.0.1:$1/health > /dev/null && break
    [ -n "$(jobs -pr)" ] || { echo "serve_c32 $2: the pdserve started in the background has exited"; return 1; }
    sleep 1; done
  for wave in first:0 second:1; do
    timeout 200 $PY -m pdserve bench serve --url http://127.0.0.1:$1 --concurrency 32 --prompt-len 512 \
      --max-tokens 64 --requests 128 --seed ${wave#*:} --out "$OUT/serve-$2-c32-${wave%:*}-$TAG" 2>&1 | grep "^requests"
  done
}
