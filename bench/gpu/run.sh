#!/usr/bin/env bash
# The GPU scripts, one entry: bash bench/gpu/run.sh NAME [STEPS or arguments...] (OUT=DIR TAG=CARD-DATE in the
# environment). Each NAME is bench/gpu/NAME.sh; its first lines say what it measures and which steps it has.
#   suite    every request ends in every mode the GPUs allow (run with every change to a GPU path)
#   decode   decode speed: kernels, engine, serving, the router          fp8      FP8 weights and KV
#   moe      mixtures of experts                                         tp       tensor parallelism (2 GPUs)
#   pp       pipeline parallelism                                        scale    four GPUs
#   disagg   conditional disaggregation and the planner                  guided   structured output on the GPU
#   migrate  decoding requests moved off a drained decode worker (2 GPUs)
#   traffic  real traffic and long prompts: prefill by length, the planner's profile, a trace replay, 100k prompts
#   tiers    KV tiers: copy rates against pinned memory, a prefix from host memory, a trace replayed twice, chaos
#   engine, nccl, fast, arrow: the engine and the nccl/arrow transports' first checks (OUT as the first argument)
set -uo pipefail
here=$(dirname "$0")
name=${1:-}
if [ -z "$name" ] || [ ! -f "$here/$name.sh" ] || [ "$name" = common ] || [ "$name" = run ]; then
  sed -n '2,12p' "$0"; exit 2
fi
shift
exec bash "$here/$name.sh" "$@"
