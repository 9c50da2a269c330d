"""Which decode path an engine gets (``cfg.decode_graphs``): CUDA graphs over the Triton kernels, the same padded
step run eagerly, or none; and the Triton layer kernels that go with the graphs."""
from __future__ import annotations

import logging

from .config import EngineConfig
from .cuda_graphs.decode import DecodeGraphs
from .kernels import paged
from .models.llama import use_kernels
from .models.moe import SparseMoE

log = logging.getLogger(__name__)


def engine_graphs(self, cfg: EngineConfig) -> DecodeGraphs | None:
    """Fixed-shape decode steps: CUDA graphs over the Triton kernels on CUDA (``auto``/``cuda``; the norms,
    rotary and MLP activation of prefill use the Triton kernels then too), the same
    padded forward run eagerly with the torch operations (``eager``), or none (``off``; ``auto`` off CUDA)."""
    mode = cfg.decode_graphs
    if mode == "cuda" and self.device.type != "cuda":
        raise ValueError(f"decode_graphs=cuda on a {self.device.type} device")
    if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
        return None
    ops, capture, layers = paged, False, None
    if mode in ("auto", "cuda") and self.device.type == "cuda":
        try:
            from .kernels import triton_layers as layers
            from .kernels import triton_attention as ops
            capture = True
        except ImportError as e:
            if mode == "cuda":
                raise RuntimeError(f"decode_graphs=cuda needs triton (pip install 'pdserve[cuda]'): {e}") from e
            log.warning("triton is not importable (%s): decode runs without CUDA graphs", e)
            return None
    if layers is not None:
        from .kernels import triton_gemv

        use_kernels(self.model, layers, triton_gemv)
        fewrow_kernels(self.model)
        fp8_kernels(self.model)
        for layer in self.model.owned_layers:  # prompt chunks rotate and store K/V in one launch
            layer.self_attn.prompt_ops = ops
        from .kernels import triton_moe

        for module in self.model.modules():
            if isinstance(module, SparseMoE):
                module.kernels = triton_moe
    max_blocks = -(-self.max_len // self.block_size) + 1
    part = None if cfg.pp == 1 else "first" if self.model.ends else "rest"  # a pipeline stage's share of the step
    graphs = DecodeGraphs(self.model, self.pool, self.device, min(cfg.max_num_seqs, 512), max_blocks, ops, capture,
                          part)
    if capture:
        graphs.prompts = prompt_graphs(self, cfg, graphs.mempool)
        graphs.mixed = mixed_graphs(self, cfg, graphs.mempool)
    return graphs


def prompt_graphs(self, cfg: EngineConfig, mempool):
    """A prompt chunk's step as a CUDA graph (``cuda_graphs.prompt``), captured into the decode graphs' memory pool;
    None where the engine cannot capture one (logged)."""
    from .cuda_graphs.prompt import MAX_CONTEXT, MAX_TOKENS, PromptGraphs, supported

    why = supported(self.model, cfg)
    if why is not None:
        log.info("prompts run eagerly, no prompt CUDA graphs: %s", why)
        return None
    most = min(cfg.max_batched_tokens or MAX_TOKENS, self.max_len)
    context = min(self.max_len, MAX_CONTEXT) if cfg.prefix_caching else 0
    return PromptGraphs(self.model, self.pool, self.device, most, True, mempool, context)


def mixed_graphs(self, cfg: EngineConfig, mempool):
    """Steps that decode and take prompt chunks as CUDA graphs (``cuda_graphs.mixed``), in the same memory pool;
    None where prompt graphs cannot be captured either."""
    from .cuda_graphs.mixed import MixedGraphs
    from .cuda_graphs.prompt import supported

    if supported(self.model, cfg) is not None:
        return None
    max_blocks = -(-self.max_len // self.block_size) + 1
    return MixedGraphs(self.model, self.pool, self.device, cfg.max_batched_tokens or self.max_len,
                       min(cfg.max_num_seqs, 512), max_blocks, True, mempool=mempool)


def fewrow_kernels(model) -> None:
    """bf16/fp16 projections of a few rows on ``triton_fewrow`` where it has a tile measured faster than cuBLAS
    (bench/RESULTS.md, decode speed)."""
    from torch import nn

    from .kernels import triton_fewrow

    if triton_fewrow.MAX_ROWS <= 0:  # a test compares the kernel against cuBLAS this way
        return
    for layer in model.owned_layers:
        for parent in (layer.self_attn, layer.ffn):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    linear.fewrow = triton_fewrow
    if triton_fewrow.NORM_ROWS > 0:
        split_norms(model)


def split_norms(model) -> None:
    """The add + RMSNorm between o and gate/up, and between down and the next layer's q/k/v, split into those
    projections' epilogues at a few rows (``triton_fewrow_norm``): in layers whose four projections are plain
    bf16/fp16 linears that do not all-reduce."""
    from torch import nn

    from .kernels import triton_fewrow_norm

    def plain(linear) -> bool:
        return isinstance(linear, nn.Linear) and getattr(getattr(linear, "group", None), "size", 1) == 1

    layers = list(model.owned_layers)
    four = [[getattr(layer.self_attn, "qkv_proj", None), getattr(layer.self_attn, "o_proj", None),
             getattr(layer.ffn, "gate_up_proj", None), getattr(layer.ffn, "down_proj", None)] for layer in layers]
    fits = [all(plain(linear) for linear in linears) for linears in four]
    for i, linears in enumerate(four):
        if fits[i]:
            for linear in linears:
                linear.fewrow = triton_fewrow_norm
            linears[1].norm_follows = True  # o: the post-attention norm launches it
            linears[3].norm_follows = i + 1 < len(layers) and fits[i + 1]  # down: the next layer's input norm


def fp8_kernels(model) -> None:
    """FP8 projections on the CUDA kernels: the activation quantization in one launch, few-row batches (batch 1
    too) on ``triton_fp8``, and the norms before q/k/v and gate/up writing e4m3 themselves."""
    from .kernels import triton_fp8, triton_quant
    from .quant.fp8_linear import Fp8Linear

    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.quantize_activations = triton_quant.quantize_rows
            module.few_rows, module.few_rows_max = triton_fp8.w8_matmul, triton_fp8.MAX_ROWS
    for layer in model.owned_layers:
        layer.input_layernorm.quantized = isinstance(layer.self_attn.qkv_proj, Fp8Linear)
        layer.post_attention_layernorm.quantized = isinstance(getattr(layer.ffn, "gate_up_proj", None), Fp8Linear)
        # batch 1 too: widening e4m3 on the CUDA cores kept triton_gemv at 40-57% of the bandwidth against the
        # tensor-core kernel's reads (H200, bench/results/kernels-fused-h200.md)
        if layer.input_layernorm.quantized:
            layer.input_layernorm.gemv = layer.self_attn.gemv = None
        if layer.post_attention_layernorm.quantized:
            layer.post_attention_layernorm.gemv = layer.ffn.gemv = None
