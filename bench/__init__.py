"""Benchmarks, each a ``pdserve bench`` command writing JSON and Markdown (most also PNG) with the command that made
them: ``transfer`` (KV transfer A/B between two processes, loopback or a shaped namespace link), ``serve`` (load
against any OpenAI-compatible endpoint), ``compare`` (colocated vs disaggregated per transport), ``soak`` (long
runs: errors and RSS growth), ``chaos`` (workers SIGKILLed under load), ``goodput`` (highest rate within an SLO per
configuration), ``stream`` (layer-wise KV streaming on and off), ``idle``, ``engine`` (the engine alone, at any
``--tp``, against the HBM limit), ``kernels`` (each decode-step kernel and whole steps, rows of equal or spread contexts, against the bandwidth and
matmul rate measured in the same run; ``--kv-cache-dtype fp8`` over an FP8 pool), ``fp8`` (FP8 weights and the FP8 KV
cache against bf16 in one run: projections, decode tok/s, sequences per KV budget, long-context steps, logits
agreement with a perturbation control), ``guided`` (structured outputs against free decode), ``pipeline`` (one
device against ``--pp 2`` against ``--tp 2`` over a shaped link, per-hop phases; on GPUs with token and logprob
agreement) and ``router`` (tokens/s one router process streams, fed by ``fake_worker``); plus GPU scripts (``random_checkpoint``, ``gpu_check``, ``nccl_check``,
``nccl_e2e``, ``allreduce`` (NCCL vs one-shot at TP sizes), ``tp_handoff`` (KV between TP groups of different
sizes, checked; on 8 GPUs groups of four and of two), ``device_*.sh``, ``bench/gpu/tp.sh``, ``bench/gpu/decode.sh``, ``bench/gpu/fp8.sh``, ``bench/gpu/moe.sh``,
``bench/gpu/disagg.sh``, ``bench/gpu/guided.sh``, ``bench/gpu/pp.sh``, ``bench/gpu/scale.sh`` (four or eight GPUs)), ``health`` (what a
cluster's ``/health`` says: nothing in flight, each worker's step times; ``python -m bench.health`` prints them since a
snapshot), ``engine_waves`` (``serve``'s closed-loop waves run on the
engine in-process: steps by kind, under prefill caps), ``profile_engine`` (torch profiles of decode, prompt and
mixed steps; the kernels of one decode graph replay against its wall time), ``pool_rows`` (a KV copy between a paged pool and one buffer by views or by index, as the blocks fall
into more runs). ``transfer --against-fp8`` moves the same KV as an FP8 cache holds it in the same run.
``engine --profile`` measures the profile ``pdserve plan`` (``planner``) simulates configurations from
(``--calibrate`` fits its long-context decode steps to a ``goodput`` report's serving steps);
``serve`` and ``goodput`` share the workloads of ``planner.workload`` (uniform ranges, ``mid``, ``long``, ``mixed``,
JSONL traces)."""
