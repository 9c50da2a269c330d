#!/usr/bin/env bash
# The arrow transport on a many-core GPU host: bench transfer against tcp and iperf3 on loopback and, where the
# machine has ip and tc, on shaped links (10 and 40 Gbit/s), one and four parallel streams; then pdserve up over
# arrow with both workers on the GPU against in-process generation, token for token.
# Usage (on the GPU machine, repo root): bash bench/device_arrow.sh OUTDIR
# Wheels for what the machine lacks go in .whl/ (pip install --no-index), an unpacked iperf3 in .whl/deb/root.
set -uo pipefail
OUT=${1:-bench/out/arrow}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps .whl/*.whl; fi
if [ -d .whl/deb/root ]; then
  export PATH=$PWD/.whl/deb/root/usr/bin:$PATH LD_LIBRARY_PATH=$PWD/.whl/deb/root/usr/lib/x86_64-linux-gnu
fi
echo "cores $(nproc); iperf3 $(command -v iperf3 || echo missing); ip $(command -v ip || echo missing); tc $(command -v tc || echo missing)" | tee "$OUT/host.txt"
transfer() {  # NAME LINK [KV-OPTION...]
  local name=$1 link=$2; shift 2
  python3 -m deploy.cli bench transfer --preset mistral-7b@871 --transports arrow,tcp --reps 16 --link "$link" \
    "$@" --out "$OUT/transfer-arrow-$name"
}
transfer loopback-16core loopback
transfer loopback-16core-4streams loopback --kv-option arrow_streams=4
if command -v ip >/dev/null && command -v tc >/dev/null; then
  transfer netns10g-16core netns:10gbit
  transfer netns40g-16core netns:40gbit
  transfer netns40g-16core-4streams netns:40gbit --kv-option arrow_streams=4
fi
python3 -m bench.nccl_e2e --transport arrow --up-arg=--device=cuda --out "$OUT/arrow-e2e-gpu.json"
