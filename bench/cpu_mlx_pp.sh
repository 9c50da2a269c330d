#!/bin/bash
# MLX pipeline decode with micro-batches in flight vs one forward at a time (PDSERVE_MLX_MICRO_BATCHES=0), side by
# side on this machine's CPU (mlx[cpu]): `pdserve up --colocated --engine mlx --pp 2` on a random stream-cpu-shape
# checkpoint (8 layers, hidden 1024, fp32), `pdserve bench serve` at concurrency 8; and one process (pp1).
#   OUT=bench/results bash bench/cpu_mlx_pp.sh
set -e
OUT=${OUT:-bench/out/mlx-pp}; mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/pdserve-stream-cpu}
[ -d "$CKPT" ] || python -m bench.random_checkpoint --shape stream-cpu --out "$CKPT" --dtype float32
for run in pp2-micro1 pp2-micro0 pp1; do
  pp=${run:2:1}; micro=${run: -1}; [ "$run" = pp1 ] && micro=1 name=mlx-pp1-cpu || name=mlx-$run-cpu
  PDSERVE_MLX_MICRO_BATCHES=$micro python -m pdserve --log-level WARNING up --colocated --engine mlx --pp $pp \
    --model "$CKPT" --port 8031 --ready-timeout 300 > "$OUT/up-$name.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do curl -sf localhost:8031/health > /dev/null && break; sleep 1; done
  python -m pdserve --log-level WARNING bench serve --url http://127.0.0.1:8031 --concurrency 8 --requests 32 \
    --warmup-requests 8 --prompt-len 64 --max-tokens 64 --out "$OUT/$name" | tail -4
  curl -s localhost:8031/health | python -c "import json,sys; w=json.load(sys.stdin)['workers']['colocated'][0]; print('pp_in_flight_max', w.get('pp_in_flight_max'))"
  kill -INT $up; wait $up || true
done
