"""The engine on MLX (Apple silicon; ``mlx[cpu]`` elsewhere): mlx-lm's model
implementations, this package's sequences, sampler and stop handling.

Prompts are prefilled one at a time (in chunks of ``max_batched_tokens``)
into a per-sequence ``KVCache`` per layer; a sequence that has its first
token joins the decode batch, whose caches are one left-padded
``BatchKVCache`` per layer (mlx-lm's): every step advances all running
sequences in one forward. Scores go to the torch sampler on the host, so
sampling, seeds and stops are exactly the torch engine's.

The KV leaves and enters in the canonical layout (per layer ``[tokens,
kv_heads, head_dim]``): ``gather_prompt`` copies a prefilled sequence's KV
out as MLX arrays (the transpose from MLX's ``[1, heads, tokens, dim]``),
``add_prefilled`` starts a sequence from received KV, torch or MLX
(converted to the model's dtype when the sender's differs). No paged pool, so no landing in
blocks and no prefix cache here."""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from .blocks import BlockManager
from .config import EngineConfig
from .engine import StepOutput
from .errors import RequestError
from .sampler import choose
from .scheduler import Batch
from .sequence import Sequence
from .tiny import TINY_NAME, build_tiny_model
from .tokenizer import ByteTokenizer, HFTokenizer

log = logging.getLogger(__name__)

TORCH_OF = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _mx():
    try:
        import mlx.core as mx
        if importlib.util.find_spec("mlx_lm") is None:
            raise ImportError("No module named 'mlx_lm'")
    except ImportError as e:
        raise RuntimeError(f"--engine mlx needs mlx and mlx-lm (pip install 'pdserve[mlx]'): {e}") from None
    return mx


def load_mlx(cfg: EngineConfig):
    """``(model, tokenizer, name, max_len, mx dtype, suppress)``."""
    mx = _mx()
    from mlx_lm.utils import load_model

    if cfg.model == TINY_NAME:
        from mlx_lm.models import llama

        hf = build_tiny_model()
        model = llama.Model(llama.ModelArgs.from_dict({**hf.config.to_dict(), "model_type": "llama"}))
        model.load_weights([(k, mx.array(v.float().numpy())) for k, v in hf.state_dict().items()])
        tokenizer, name, config = ByteTokenizer(), TINY_NAME, hf.config.to_dict()
        suppress = list(hf.generation_config.suppress_tokens or []) or None
    elif os.path.isdir(cfg.model):
        model, config = load_model(Path(cfg.model))
        tokenizer, name = HFTokenizer(cfg.model), os.path.basename(os.path.normpath(cfg.model))
        suppress = None
    else:
        raise ValueError(f"model {cfg.model!r} is neither {TINY_NAME!r} nor a local checkpoint directory")
    dtype = {"auto": None, "float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[cfg.dtype]
    if dtype is None and cfg.model == TINY_NAME:
        dtype = mx.float32
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    max_len = config.get("max_position_embeddings") or 2048
    if cfg.max_model_len:
        max_len = min(max_len, cfg.max_model_len)
    return model, tokenizer, cfg.served_name or name, max_len, dtype, suppress


class MlxEngine:
    kind = "mlx"
    paged = False

    def __init__(self, cfg: EngineConfig, hold_after_first: bool = False, pool_memory=None):
        self.mx = _mx()
        from mlx_lm.models.cache import BatchKVCache, KVCache

        self._batch_cache, self._cache = BatchKVCache, KVCache
        self.cfg = cfg
        self.model, self.tokenizer, self.name, self.max_len, dtype, suppress = load_mlx(cfg)
        layer = self.model.layers[0].self_attn
        heads = getattr(layer, "n_kv_heads", None) or getattr(layer, "num_key_value_heads")
        head_dim = layer.k_proj.weight.shape[0] // heads if hasattr(layer, "k_proj") else layer.head_dim
        self.mx_dtype = dtype or self.model.layers[0].input_layernorm.weight.dtype  # norms stay unquantized
        self.dtype = TORCH_OF[str(self.mx_dtype).split(".")[-1]]
        self.device = torch.device("cpu")
        self.kv_shape = (len(self.model.layers), int(heads), int(head_dim))
        self.kv_bytes_per_token = 2 * self.kv_shape[0] * self.kv_shape[1] * self.kv_shape[2] * self.dtype.itemsize
        self.block_size = cfg.block_size
        budget = cfg.kv_budget_bytes or min(cfg.max_num_seqs * self.max_len * self.kv_bytes_per_token, 2 << 30)
        self.num_blocks = max(2, budget // (self.block_size * self.kv_bytes_per_token))
        self.blocks = BlockManager(self.num_blocks, self.block_size)  # admission accounting only
        self.scheduler = self
        self.preemptions = 0
        self.suppress = torch.tensor(suppress) if suppress else None
        self.hold_after_first = hold_after_first
        self.on_schedule = None
        self.budget = cfg.max_batched_tokens or 2048
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.caches: dict[str, list] = {}
        self.batch = None
        log.info("mlx engine: %s (%s), context %d", self.name, self.mx_dtype, self.max_len)

    @property
    def kv_capacity_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def keys(self, seq, tokens):
        return []

    def cached_prefix(self, keys) -> list:
        return []

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefix_info(self) -> dict:
        return {"tokenizer": self.cfg.tokenizer_source, "kv_block_size": self.block_size, "prefix_caching": False, "engine": self.kind}

    def add(self, seq: Sequence) -> None:
        if seq.params.prompt_logprobs is not None:
            raise RequestError("prompt logprobs are not supported by the mlx engine", param="prompt_logprobs")
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, layers, prefix=None) -> bool:
        """Start ``seq`` from its prompt's KV: canonical ``(k, v)`` host tensors per layer, any float dtype."""
        mx, caches = self.mx, []
        for k, v in layers:
            cache = self._cache()
            cache.keys, cache.values = (self._to_mx(t) for t in (k, v))
            cache.offset = int(k.shape[0])
            caches.append(cache)
        seq.num_computed = len(seq.prompt_ids)
        self._join(seq, caches)
        mx.eval([c.keys for c in caches])
        return True

    def _to_mx(self, t):
        """An MLX array ``[1, heads, tokens, dim]`` in the model's dtype from canonical KV (torch or MLX)."""
        if isinstance(t, torch.Tensor):
            t = t.detach().to("cpu").contiguous()
            t = self.mx.array(t.view(torch.uint16).numpy()).view(self.mx.bfloat16) if t.dtype == torch.bfloat16 \
                else self.mx.array(t.numpy())
        return t.astype(self.mx_dtype).transpose(1, 0, 2)[None]

    def _join(self, seq, caches) -> None:
        batch = [self._batch_cache.merge([c]) for c in caches]
        if self.batch is None:
            self.batch = batch
        else:
            for mine, new in zip(self.batch, batch):
                mine.extend(new)
        self.running.append(seq)

    def _scores(self, logits) -> torch.Tensor:
        scores = torch.from_numpy(np.array(logits.astype(self.mx.float32)))
        if self.suppress is not None:
            scores[:, self.suppress] = float("-inf")
        return scores

    def step(self) -> StepOutput:
        """One decode step of the running batch, then a chunk of the oldest waiting prompt (which joins the batch
        for the next step once it has its first token)."""
        out = StepOutput()
        if self.running:
            self._decode(out)
        if self.waiting:
            seq = self.waiting[0]
            if self.on_schedule is not None:
                batch = Batch()
                batch.add(seq, min(seq.num_tokens - seq.num_computed, self.budget))
                self.on_schedule(batch)
            self._prefill(seq, out)
        return out

    def _prefill(self, seq: Sequence, out: StepOutput) -> None:
        mx = self.mx
        if len(seq.prompt_ids) + 1 > self.num_blocks * self.block_size:
            self.waiting.popleft()
            out.refused.append(seq)
            return
        caches = self.caches.setdefault(seq.rid, [self._cache() for _ in self.model.layers])
        chunk = min(seq.num_tokens - seq.num_computed, self.budget)
        seq.scheduled_at = seq.scheduled_at or time.perf_counter()
        ids = mx.array([seq.tokens(seq.num_computed, seq.num_computed + chunk)])
        logits = self.model(ids, cache=caches)[:, -1, :]
        seq.num_computed += chunk
        out.scheduled.append(seq)
        out.batch_tokens += chunk
        if seq.num_computed < seq.num_tokens:
            mx.eval([c.keys for c in caches])
            return
        self.waiting.popleft()
        choice = choose(self._scores(logits), [seq], self.tokenizer.eos_token_id)[0]
        out.tokens.append((seq, seq.append(choice)))
        if self.hold_after_first:
            return
        del self.caches[seq.rid]
        if not seq.finished:
            self._join(seq, caches)

    def _decode(self, out: StepOutput) -> None:
        ids = self.mx.array([[s.output_ids[-1]] for s in self.running])
        logits = self.model(ids, cache=self.batch)[:, -1, :]
        for s in self.running:
            s.num_computed += 1
        choices = choose(self._scores(logits), self.running, self.tokenizer.eos_token_id)
        out.batch_tokens += len(self.running)
        for seq, choice in zip(list(self.running), choices):
            out.tokens.append((seq, seq.append(choice)))
            if seq.finished:
                self.free(seq)

    def free(self, seq: Sequence) -> None:
        self.caches.pop(seq.rid, None)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            keep = [i for i, s in enumerate(self.running) if s is not seq]
            self.running = [self.running[i] for i in keep]
            if keep:
                index = self.mx.array(keep)
                for cache in self.batch:
                    cache.filter(index)
            else:
                self.batch = None

    def gather_prompt(self, seq: Sequence, skip_tokens: int = 0) -> list:
        """The prompt's KV after ``skip_tokens`` as MLX arrays in the canonical layout (one copy: the transpose),
        evaluated; transports take them as they are (mlx) or as views of their memory."""
        mx, n = self.mx, len(seq.prompt_ids)
        out = [tuple(mx.contiguous(a[0, :, skip_tokens:n, :].transpose(1, 0, 2)) for a in (c.keys, c.values))
               for c in self.caches[seq.rid]]
        mx.eval(out)
        return out

    def release(self, table) -> None:
        pass
