"""The Llama family as plain torch modules over the paged KV pool: Llama 2/3,
Mistral, Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on q and k per head), and
their mixture-of-experts relatives Mixtral and Qwen3-MoE (``moe``: a sparse
block in place of the MLP).
Parameter names follow the Hugging Face checkpoints, so their tensors load
by name. ``forward`` takes the packed new tokens of a batch, their positions
and the attention metadata, and returns hidden states; ``logits`` projects
the rows asked for. Built with a tensor-parallel group, each module holds
its rank's shard (``engine.parallel``) and the forward is the same."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention import AttnMeta, attend
from ..parallel.group import SINGLE, TPGroup
from ..parallel.heads import HeadShard
from ..parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from .moe import MoESpec, SparseMoE
from .rope import Rotary


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    moe: MoESpec | None = None

    @classmethod
    def from_hf(cls, c, qkv_bias: bool = False, qk_norm: bool = False, moe: str | None = None) -> "ModelSpec":
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or None
        theta = getattr(c, "rope_theta", None) or (rope or {}).get("rope_theta") or 10000.0
        window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=c.rms_norm_eps,
            rope_theta=float(theta), rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(getattr(c, "attention_bias", False)), qk_norm=qk_norm,
            sliding_window=window if window and window < c.max_position_embeddings else None,
            moe=MoESpec.from_hf(c, moe) if moe else None)


def project(gemv, linear: nn.Module, x) -> torch.Tensor:
    """``linear(x)``, one row (or a deferred norm) on ``gemv`` (``triton_gemv``) when the engine has it, a few rows
    on the linear's ``fewrow`` kernel (``triton_fewrow``) where it has a tile for them."""
    if gemv is not None and gemv.takes(x):
        return gemv.linear(x, linear)
    fewrow = getattr(linear, "fewrow", None)
    if fewrow is not None and fewrow.takes(x, linear):
        return fewrow.linear(x, linear)
    return linear(x)


class RMSNorm(nn.Module):
    kernels = None  # ``triton_layers`` (see ``use_kernels``)
    quantized = False  # with kernels: the output quantized for the FP8 projection after it (``quant.fp8_linear``)
    gemv = None  # ``triton_gemv``: one row is normed by the projection after it (``Normed``)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The normed ``x``; with ``residual``: ``(normed x + residual, x + residual)`` (the sum in ``x``'s dtype)."""
        after = getattr(x, "norm_after", None)  # a projection left for this norm to launch (``triton_fewrow_norm``)
        if after is not None:
            done = after(residual, self.weight, self.eps)
            if done is not None:
                return done
            x = x.resolve()
        if self.gemv is not None and self.gemv.takes(x):
            return self.gemv.defer(x, residual, self.weight, self.eps)
        if self.kernels is not None and self.quantized:
            return self.kernels.rmsnorm_fp8(x, self.weight, self.eps, residual)
        if residual is not None:
            if self.kernels is not None:
                return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)
            x = x + residual
            return self.forward(x), x
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    gemv = None  # ``triton_gemv`` (see ``use_kernels``)
    prompt_ops = None  # ``triton_attention``: prompt chunks rotate and store K/V in one launch (``rope_store``)

    def __init__(self, s: ModelSpec, rotary: Rotary, group: TPGroup = SINGLE):
        super().__init__()
        self.s, self.rotary = s, rotary
        shard = HeadShard(s.num_heads, s.num_kv_heads, group.size, group.rank)
        self.heads, self.kv_heads, d = shard.heads, shard.kv_heads, s.head_dim
        q = [(group.rank * self.heads * d, self.heads * d)]
        kv = [(shard.kv_start * d, self.kv_heads * d)]
        q_full, kv_full = s.num_heads * d, s.num_kv_heads * d
        self.q_proj = ColumnParallelLinear(s.hidden_size, q, q_full, bias=s.qkv_bias)
        self.k_proj = ColumnParallelLinear(s.hidden_size, kv, kv_full, bias=s.qkv_bias)
        self.v_proj = ColumnParallelLinear(s.hidden_size, kv, kv_full, bias=s.qkv_bias)
        self.o_proj = RowParallelLinear(q[0][0], q[0][1], q_full, s.hidden_size, group)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.scale = s.head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # an FP8 KV cache's scales (an FP8 checkpoint's k_scale/v_scale)
        self.kv_scales = None  # (k_scale, v_scale) while the pool is FP8 (``use_fp8_kv``)

    def forward(self, x, positions, meta: AttnMeta, k_cache, v_cache):
        qkv = project(self.gemv, self.qkv_proj, x)  # x: maybe ``Quantized`` or ``Normed`` (a fused norm)
        if meta.mixed_graph is not None:  # a mixed step's graph (``cuda_graphs.mixed``)
            return project(self.gemv, self.o_proj, meta.mixed_graph.attend(self, qkv, k_cache, v_cache))
        n = qkv.shape[0]
        if meta.paged is not None and not self.s.qk_norm:  # one kernel rotates and stores; attention reads the pool
            out = meta.paged.rope_decode(qkv, meta.cos, meta.sin, k_cache, v_cache, meta.slot_mapping, self.heads,
                                         self.kv_heads, meta.tables, meta.lens, self.scale, meta.window, self.kv_scales)
            return project(self.gemv, self.o_proj, out.reshape(n, -1))
        return project(self.gemv, self.o_proj, self.core(qkv, positions, meta, k_cache, v_cache))

    def core(self, qkv, positions, meta: AttnMeta, k_cache, v_cache) -> torch.Tensor:
        """Attention between the q/k/v and o projections: rotary, the new K/V into the pool, attention over it;
        ``[tokens, heads * head_dim]``."""
        n, d = qkv.shape[0], self.s.head_dim
        if self.prompt_ops is not None and meta.cos is not None and not self.s.qk_norm:
            q, k, v = self.prompt_ops.rope_store(qkv, meta.cos, meta.sin, k_cache, v_cache, meta.slot_mapping,
                                                 self.heads, self.kv_heads, self.kv_scales, keep=True)
            return attend(q, k, v, k_cache, v_cache, meta, self.scale, self.kv_scales, stored=True).reshape(n, -1)
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(n, self.heads, d), k.view(n, self.kv_heads, d), v.view(n, self.kv_heads, d)
        if self.s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, meta.cos, meta.sin)
        return attend(q, k, v, k_cache, v_cache, meta, self.scale, self.kv_scales).reshape(n, -1)


class MLP(nn.Module):
    kernels = None  # ``triton_layers`` (see ``use_kernels``)
    gemv = None  # ``triton_gemv``: gate/up with SiLU-times-up in one launch for one row

    def __init__(self, s: ModelSpec, group: TPGroup = SINGLE):
        super().__init__()
        if s.intermediate_size % group.size:
            raise ValueError(f"--tp {group.size} does not divide the MLP width {s.intermediate_size}")
        part = s.intermediate_size // group.size
        rows = [(group.rank * part, part)]
        width = s.intermediate_size
        self.gate_proj = ColumnParallelLinear(s.hidden_size, rows, width)
        self.up_proj = ColumnParallelLinear(s.hidden_size, rows, width)
        self.down_proj = RowParallelLinear(rows[0][0], part, width, s.hidden_size, group)

    def forward(self, x):
        if self.gemv is not None and self.gemv.takes(x):
            return project(self.gemv, self.down_proj, self.gemv.linear(x, self.gate_up_proj, silu=True))
        gate_up = project(None, self.gate_up_proj, x)
        if self.kernels is not None:
            return project(None, self.down_proj, self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelSpec, rotary: Rotary, group: TPGroup = SINGLE, index: int = 0):
        super().__init__()
        self.self_attn = Attention(s, rotary, group)
        sparse = s.moe is not None and index in s.moe.sparse_layers
        self.ffn_name = s.moe.module_name if sparse else "mlp"  # the checkpoint's name for the block
        setattr(self, self.ffn_name, SparseMoE(s.hidden_size, s.moe, group) if sparse else MLP(s, group))
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, residual, positions, meta, k_cache, v_cache):
        """``(this layer's output, the residual stream before it)``: the next norm adds them (one kernel)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, meta, k_cache, v_cache), residual)
        return self.ffn(h), residual

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward block: ``MLP``, or ``SparseMoE`` (under ``block_sparse_moe`` in Mixtral)."""
        return getattr(self, self.ffn_name)


class Backbone(nn.Module):
    def __init__(self, s: ModelSpec, rotary: Rotary, group: TPGroup = SINGLE, span: tuple[int, int] | None = None,
                 ends: bool = True):
        """``span``: the layers ``[first, end)`` this pipeline stage holds (the others are empty modules, so the
        checkpoint's names still match); ``ends``: it holds the embedding and the final norm (stage 0)."""
        super().__init__()
        first, end = span or (0, s.num_layers)
        if ends:
            self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size, group)
            self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(s, rotary, group, i) if first <= i < end else nn.Module()
                                    for i in range(s.num_layers))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, group: TPGroup = SINGLE, span: tuple[int, int] | None = None):
        """``span``: a pipeline stage's layers ``[first, end)`` (``engine.pipeline``); the stage holding layer 0
        also holds the embedding, the final norm and the LM head, and samples."""
        super().__init__()
        self.spec, self.group = spec, group
        self.span = span or (0, spec.num_layers)
        self.ends = self.span[0] == 0
        self.heads = HeadShard(spec.num_heads, spec.num_kv_heads, group.size, group.rank)
        self.rotary = rotary = Rotary(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        self.model = Backbone(spec, rotary, group, self.span, self.ends)
        if self.ends:
            self.lm_head = ParallelLMHead(spec.hidden_size, spec.vocab_size, group)
        self.tie()

    @property
    def owned_layers(self) -> list:
        """This stage's decoder layers, in order (all of them without a pipeline)."""
        return list(self.model.layers[self.span[0]:self.span[1]])

    def fuse(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer, which ``forward`` uses (called once the weights
        are loaded by their HF names): fewer, larger launches that read each weight once."""
        for layer in self.owned_layers:
            a, m = layer.self_attn, layer.ffn
            a.qkv_proj = _joined(a.q_proj, a.k_proj, a.v_proj)
            del a.q_proj, a.k_proj, a.v_proj
            if isinstance(m, SparseMoE):
                m.fuse()
                continue
            m.gate_up_proj = _joined(m.gate_proj, m.up_proj)
            del m.gate_proj, m.up_proj

    def tie(self) -> None:
        if self.spec.tie_word_embeddings and self.ends:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttnMeta, kv_cache: list) -> torch.Tensor:
        self.group.begin_forward()
        x, residual = self.model.embed_tokens(input_ids), None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_cache)):
            x, residual = layer(x, residual, positions, meta, k_cache, v_cache)
            if meta.on_layer is not None:
                meta.on_layer(i)
        return self.model.norm(x, residual)[0]

    def stage_forward(self, x, positions, meta: AttnMeta, kv_cache: list) -> torch.Tensor:
        """A pipeline stage's part: token ids (stage 0) or the residual stream from the stage before through this
        stage's layers (``kv_cache``: their pool layers); returns the residual stream after them (``x + residual``,
        added as the next layer's norm would add them, so the split forward equals the whole one)."""
        self.group.begin_forward()
        if self.ends:
            x = self.model.embed_tokens(x)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.owned_layers, kv_cache)):
            x, residual = layer(x, residual, positions, meta, k_cache, v_cache)
            if meta.on_layer is not None:
                meta.on_layer(i)
        return x + residual

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Stage 0: the final norm of the residual stream the last stage returned."""
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def use_fp8_kv(model: nn.Module, on: bool) -> list:
    """Attention reads and writes an FP8 pool (``quant.kv_fp8``) with each layer's scales, or not; returns the
    scales per layer ``(k_scale, v_scale)``."""
    scales = []
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_scales = (module.k_scale, module.v_scale) if on else None
            scales.append((module.k_scale, module.v_scale))
    return scales


def use_kernels(model: nn.Module, kernels, gemv=None) -> None:
    """Run every RMSNorm, MLP activation and the rotary embedding of ``model`` with ``kernels``
    (``triton_layers``; None: the torch forms); with ``gemv`` (``triton_gemv``) one row (batch 1) runs each layer's
    projections with the norms before them and SiLU-times-up fused in."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Rotary, MLP)):
            module.kernels = kernels
    for layer in model.owned_layers:
        layer.self_attn.gemv = layer.input_layernorm.gemv = gemv
        if isinstance(layer.ffn, MLP):
            layer.ffn.gemv = layer.post_attention_layernorm.gemv = gemv


def _joined(*linears: nn.Linear) -> nn.Linear:
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    with torch.device("meta"):
        joined = nn.Linear(first.in_features, out, bias=first.bias is not None)
    joined.weight = nn.Parameter(torch.cat([lin.weight.data for lin in linears]), requires_grad=False)
    rows = [getattr(lin.weight, "fp8_row_scale", None) for lin in linears]  # an FP8 checkpoint's grid (quant)
    if all(r is not None for r in rows):
        joined.weight.fp8_row_scale = torch.cat(rows)
    if first.bias is not None:
        joined.bias = nn.Parameter(torch.cat([lin.bias.data for lin in linears]), requires_grad=False)
    return joined
