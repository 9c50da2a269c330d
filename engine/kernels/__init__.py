"""The engine's kernels beyond torch's own.

``paged``: decode attention straight over the paged pool with fixed shapes, the new tokens' rotary + K/V store
in one operation, in torch (any device; the reference the others are tested against). ``triton_attention``: the
same operations as Triton kernels (CUDA; what the decode CUDA graphs capture). ``triton_layers``: RMSNorm (with
the residual add fused; writing e4m3 before an FP8 projection), rotary and SiLU-times-up as one Triton kernel each.
``triton_quant``: activations quantized per row for FP8 projections; ``triton_fp8``: the FP8-weight GEMM for a few
rows (decode). ``triton_gemv``: batch-1 projections with the norm before and SiLU-times-up after fused in;
``triton_pdl``: programmatic dependent launch for the decode step's kernels (Hopper+). Every Triton kernel rounds where its
torch form rounds, so bf16 results match (tests: ``tests/test_triton_ops.py``, on a GPU or under
``TRITON_INTERPRET=1``; timings and fractions of the device's limits: ``pdserve bench kernels``)."""
