"""Quantized storage and compute: ``kv_fp8`` (the FP8 KV cache: e4m3 values with a scale per layer for K and for V,
what the pool stores and the attention kernels read), ``fp8_linear`` (FP8 weights with per-output-channel scales,
activations quantized per token on the fly, ``torch._scaled_mm`` on CUDA) and ``checkpoint`` (reading FP8
checkpoints' scales, quantizing bf16 ones at load)."""
