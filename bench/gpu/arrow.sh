#!/usr/bin/env bash
# The arrow transport on a many-core GPU host: bench transfer against tcp and iperf3 on loopback and, where the
# machine has ip and tc, on shaped links (10 and 40 Gbit/s), one and four parallel streams; then pdserve up over
# arrow with both workers on the GPU against in-process generation, token for token; then 1P1D on that one GPU
# with a random Mistral-7B-shape bf16 checkpoint, `pdserve bench serve` over tcp and over arrow.
# Usage (on the GPU machine, repo root): bash bench/gpu/run.sh arrow OUTDIR [transfer|serve|all]
# Wheels for what the machine lacks go in .whl/ (pip install --no-index), an unpacked iperf3 in .whl/deb/root.
set -uo pipefail
OUT=${1:-bench/out/arrow}; WHAT=${2:-all}; mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/mistral-7b}
source "$(dirname "$0")/common.sh"
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps .whl/*.whl; fi
if [ -d .whl/deb/root ]; then
  export PATH=$PWD/.whl/deb/root/usr/bin:$PATH LD_LIBRARY_PATH=$PWD/.whl/deb/root/usr/lib/x86_64-linux-gnu
fi
echo "cores $(nproc); iperf3 $(command -v iperf3 || echo missing); ip $(command -v ip || echo missing); tc $(command -v tc || echo missing)" | tee "$OUT/host.txt"
transfer() {  # NAME LINK [KV-OPTION...]
  local name=$1 link=$2; shift 2
  python3 -m pdserve bench transfer --preset mistral-7b@871 --transports arrow,tcp --reps 16 --link "$link" \
    "$@" --out "$OUT/transfer-arrow-$name"
}
if [ "$WHAT" != serve ]; then
  transfer loopback-16core loopback
  transfer loopback-16core-4streams loopback --kv-option arrow_streams=4
  if command -v ip >/dev/null && command -v tc >/dev/null; then
    transfer netns10g-16core netns:10gbit
    transfer netns40g-16core netns:40gbit
    transfer netns40g-16core-4streams netns:40gbit --kv-option arrow_streams=4
  fi
  python3 -m bench.nccl_e2e --transport arrow --up-arg=--device=cuda --out "$OUT/arrow-e2e-gpu.json"
fi
if [ "$WHAT" != transfer ]; then
  [ -f "$CKPT/config.json" ] || python3 -m bench.random_checkpoint --shape mistral-7b --out "$CKPT"
  for t in tcp arrow; do
    python3 -m pdserve --log-level WARNING up --transport "$t" --model "$CKPT" --dtype bfloat16 --device cuda \
      --port 8000 --ready-timeout 300 &
    UP=$!
    for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
    python3 -m pdserve bench serve --url http://127.0.0.1:8000 --requests 96 --concurrency 16 --prompt-len 871 \
      --max-tokens 32 --out "$OUT/serve-1p1d-$t-h100"
    kill -TERM $UP; wait $UP
  done
fi
