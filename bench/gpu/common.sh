# Sourced by every script of bench/gpu/ (after it sets its default OUT and TAG): NVLink multicast off (a program that
# uses it can take a host's shared GPUs out of service), unbuffered Python output, the repository on PYTHONPATH,
# $PY, and $OUT made.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-python3}
OUT=${OUT:-bench/out/gpu}; TAG=${TAG:-gpu}
mkdir -p "$OUT"
