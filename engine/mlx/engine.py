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
(converted to the model's dtype when the sender's differs). A decoding
sequence that moves to another worker is set aside (its rows copied out of
the batch into caches of its own), its KV then leaves as a prompt's does
(``kv_out``), and it rejoins the batch if the move fails (``take_back``).
No paged pool, so no landing in blocks and no prefix cache here.

With ``--tp N`` the model is mlx-lm's sharded one and the other ranks replay
this engine's operations (``parallel.mlx_group``; ``follow`` on their side):
``mlx_add``, ``mlx_prefilled`` (their heads of the KV), ``mlx_free``,
``mlx_gather`` (an all-gather of the heads), ``mlx_park``/``mlx_unpark``, and ``mlx_step``, inside which
rank 0 sends ``mlx_chosen`` (its tokens, and which sequences finished) after
each forward."""
from __future__ import annotations

import logging
import os
import time
from collections import deque

import numpy as np
import torch

from ..blocks import BlockManager
from ..config import EngineConfig
from ..emitted import Emitted
from ..step_output import StepOutput
from ..errors import RequestError
from ..guided.grammars import engine_guides
from ..parallel.group import SINGLE, TPGroup
from ..sampler import TokenChoice, choose
from ..scheduler import Batch
from ..sequence import Sequence
from .batches import Chunk, MlxBatches
from .loader import _mx, load_mlx

log = logging.getLogger(__name__)

TORCH_OF = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class MlxEngine:
    kind = "mlx"
    paged = False

    def __init__(self, cfg: EngineConfig, hold_after_first: bool = False, pool_memory=None,
                 group: TPGroup | None = None, plan_in=None, tp_kv=None):
        """``group``/``plan_in``: a follower rank's group and plan; rank 0 of ``--tp N`` starts its group here."""
        self.mx = _mx()
        from mlx_lm.models.cache import BatchKVCache, KVCache

        self._batch_cache, self._cache = BatchKVCache, KVCache
        self.cfg = cfg
        if group is None and (cfg.tp > 1 or cfg.pp > 1):
            import dataclasses

            from ..parallel.launch import start_group

            group = start_group(dataclasses.replace(cfg, engine="mlx"), torch.device("cpu"))
        self.group, self.plan, self.plan_in = group or SINGLE, (group or SINGLE).plan, plan_in
        self._done: set = set()
        if cfg.kv_cache_dtype != "auto" or cfg.quantization:
            raise ValueError("the mlx engine keeps its KV in the model's dtype (mlx-lm's batched decode cache has no "
                             "quantized form) and takes no --quantization (load an mlx-lm quantized model instead)")
        self.model, self.tokenizer, self.name, self.max_len, dtype, suppress = load_mlx(cfg)
        layer = self.model.layers[0].self_attn
        heads = getattr(layer, "n_kv_heads", None) or getattr(layer, "num_key_value_heads")
        head_dim = layer.k_proj.weight.shape[0] // heads if hasattr(layer, "k_proj") else layer.head_dim
        self.mx_dtype = dtype or self.model.layers[0].input_layernorm.weight.dtype  # norms stay unquantized
        self.dtype = TORCH_OF[str(self.mx_dtype).split(".")[-1]]
        self.device = torch.device("cpu")
        self.kv_dtype, self.kv_scales = self.dtype, None  # the caches keep the model's dtype (see load_mlx)
        self.kv_shape = (len(self.model.layers), int(heads), int(head_dim))  # whole heads: what rank 0 sends
        self.model_kv_shape = self.kv_shape
        self.pipeline = None
        if self.group.size > 1 and cfg.pp > 1:
            from ..pipeline.mlx_stages import MlxStages

            self.pipeline = MlxStages(self.model, self.group, cfg.pp_layers, self.plan,
                                      plan_in.report if plan_in is not None else None)
        elif self.group.size > 1:
            from ..parallel.mlx_group import check

            check(self.model, self.group.size)
            self.model.shard(self.group.group)
            self.mx.eval(self.model.parameters())
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
        self.caches: dict[str, list] = {}
        self.mirrors: dict[str, Sequence] = {}  # a follower's copies of rank 0's sequences
        # PDSERVE_MLX_MICRO_BATCHES=0: one forward in a pipeline at a time (the A/B of bench/results/mlx-pp-*)
        overlap = self.pipeline is not None and os.environ.get("PDSERVE_MLX_MICRO_BATCHES", "1") != "0"
        self.micro = MlxBatches(self, self.pipeline.size if overlap else 1)
        self._tell("mlx_config", hold_after_first=hold_after_first)
        log.info("mlx engine: %s (%s), context %d", self.name, self.mx_dtype, self.max_len)

    @property
    def kv_capacity_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def running(self) -> list[Sequence]:
        return self.micro.running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.micro.flights)

    def keys(self, seq, tokens):
        return []

    def cached_prefix(self, keys) -> list:
        return []

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefix_info(self) -> dict:
        return {"tokenizer": self.cfg.tokenizer_source, "kv_block_size": self.block_size, "prefix_caching": False,
                "engine": self.kind, "vocab_size": self.tokenizer.vocab_size}

    def add(self, seq: Sequence) -> None:
        if seq.params.prompt_logprobs is not None:
            raise RequestError("prompt logprobs are not supported by the mlx engine", param="prompt_logprobs")
        self._tell("mlx_add", rid=seq.rid, prompt_ids=list(seq.prompt_ids))
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, layers, prefix=None) -> bool:
        """Start ``seq`` from its prompt's KV: canonical ``(k, v)`` host tensors per layer, any float dtype (all
        heads: with ``--tp`` each rank keeps its own)."""
        mx, caches = self.mx, []
        if self.group.size > 1 and self.plan_in is None:
            layers = self._share(seq, layers)
        for k, v in layers:
            cache = self._cache()
            cache.keys, cache.values = (self._to_mx(t) for t in (k, v))
            cache.offset = int(k.shape[0])
            caches.append(cache)
        seq.num_computed = caches[0].offset  # the prompt's tokens, and a moved sequence's outputs but its last
        self._join(seq, caches)
        mx.eval([c.keys for c in caches])
        return True

    def _to_mx(self, t):
        """An MLX array ``[1, heads, tokens, dim]`` in the model's dtype from canonical KV (torch or MLX)."""
        return self._canonical(t).transpose(1, 0, 2)[None]

    def _canonical(self, t):
        """Canonical KV ``[tokens, heads, dim]`` (torch or MLX) as an MLX array in the model's dtype."""
        if isinstance(t, torch.Tensor):
            t = t.detach().to("cpu").contiguous()
            t = self.mx.array(t.view(torch.uint16).numpy()).view(self.mx.bfloat16) if t.dtype == torch.bfloat16 \
                else self.mx.array(t.numpy())
        return t.astype(self.mx_dtype)

    def _share(self, seq, layers) -> list:
        """(Rank 0) Send every other rank its heads (its layers, in a pipeline) of this KV with the sequence
        (``mlx_prefilled``); keep ours."""
        from ..parallel.mlx_group import heads_slice

        mx, size = self.mx, self.group.size
        full = [tuple(self._canonical(t) for t in kv) for kv in layers]
        wire = mx.uint16 if self.mx_dtype in (mx.bfloat16, mx.float16) else mx.uint32
        if self.pipeline is not None:
            shares = self.pipeline.share(full)
        else:
            shares = [[[heads_slice(a, rank, size) for a in kv] for kv in full] for rank in range(size)]
        for rank in range(1, size):
            parts = shares[rank]
            mx.eval(parts)
            self.plan.send_to(rank, "mlx_prefilled", rid=seq.rid, prompt_ids=list(seq.prompt_ids),
                              output_ids=list(seq.output_ids), shape=list(parts[0][0].shape),
                              layers=[[np.array(a.view(wire)).tobytes() for a in kv] for kv in parts])
        return shares[0]

    def follow(self, msg: dict) -> None:
        """(A follower rank) Replay one of rank 0's operations (see the module docstring)."""
        op, rid = msg["op"], msg.get("rid")
        if op == "mlx_config":
            self.hold_after_first = msg["hold_after_first"]
        elif op == "mlx_add":
            self.waiting.append(self._mirror(rid, msg["prompt_ids"]))
        elif op == "mlx_step":
            self.step()
        elif op in ("mlx_free", "mlx_gather", "mlx_park", "mlx_unpark"):
            seq = self.mirrors.get(rid)
            if seq is None:
                return
            if op == "mlx_free":
                self._drop(seq)
            elif op == "mlx_gather":
                self._gather(seq, msg["skip"], msg["end"])
            else:
                (self._park if op == "mlx_park" else self._unpark)(seq)
        elif op == "mlx_prefilled":
            seq = self._mirror(rid, msg["prompt_ids"])
            seq.output_ids = list(msg["output_ids"])
            mx = self.mx
            wire = np.uint16 if self.mx_dtype in (mx.bfloat16, mx.float16) else np.uint32
            layers = [tuple(mx.array(np.frombuffer(b, wire).reshape(msg["shape"])).view(self.mx_dtype) for b in kv)
                      for kv in msg["layers"]]
            self.add_prefilled(seq, layers)

    def _mirror(self, rid: str, prompt_ids: list) -> Sequence:
        """A follower's copy of rank 0's sequence: its tokens come from rank 0, it never finishes on its own."""
        from ..sampling import SamplingParams

        params = SamplingParams(max_tokens=self.max_len, temperature=0, ignore_eos=True)
        seq = self.mirrors[rid] = Sequence(rid, list(prompt_ids), params, self.tokenizer, self.max_len)
        return seq

    def _join(self, seq, caches) -> None:
        self.micro.join(seq, caches)

    guides = property(engine_guides)  # masks applied by the torch sampler these scores go to

    def _scores(self, logits) -> torch.Tensor:
        scores = torch.from_numpy(np.array(logits.astype(self.mx.float32)))
        if self.suppress is not None:
            scores[:, self.suppress] = float("-inf")
        return scores

    def step(self) -> StepOutput:
        """A decode step of the running micro-batches and a chunk of the oldest waiting prompt (which joins a
        micro-batch once it has its first token); in a pipeline they are launched and landed as ``batches``
        says."""
        self._tell("mlx_step")
        out = StepOutput()
        self.micro.step(out)
        return out

    def launch_chunk(self, out: StepOutput) -> Chunk | None:
        """The next chunk of the oldest waiting prompt whose chunks are not all launched, started (lazily without a
        pipeline, through this stage in one); a prompt too long for the KV budget is refused."""
        seq = next((s for s in self.waiting if s.num_computed < s.num_tokens), None)
        if seq is None:
            return None
        if len(seq.prompt_ids) + 1 > self.num_blocks * self.block_size:
            self.waiting.remove(seq)
            out.refused.append(seq)
            return None
        chunk = min(seq.num_tokens - seq.num_computed, self.budget)
        if self.on_schedule is not None:
            batch = Batch()
            batch.add(seq, chunk)
            self.on_schedule(batch)
        caches = self.caches.setdefault(seq.rid, [self._cache() for _ in self.model.layers])
        seq.scheduled_at = seq.scheduled_at or time.perf_counter()
        ids = self.mx.array([seq.tokens(seq.num_computed, seq.num_computed + chunk)])
        seq.num_computed += chunk
        out.scheduled.append(seq)
        out.batch_tokens += chunk
        last = seq.num_computed >= seq.num_tokens
        if self.pipeline is None:
            return Chunk(seq, caches, chunk, last, logits=self.model(ids, cache=caches))
        return Chunk(seq, caches, chunk, last, tag=self.pipeline.launch(ids, caches))

    def land_chunk(self, chunk: Chunk, logits, out: StepOutput) -> None:
        """A chunk's forward done (``logits``: its last position's): the prompt's first token after its last chunk (then it joins a micro-batch, or
        waits with its KV on a prefill worker)."""
        seq, caches = chunk.seq, chunk.caches
        if not chunk.last:
            if self.pipeline is None:
                self.mx.eval([c.keys for c in caches])
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        choice = self._pick(logits, [seq])[0]
        out.tokens.append(Emitted.of(seq, seq.append(choice)))
        self._chosen([seq])
        if self.hold_after_first:
            return
        del self.caches[seq.rid]
        if not self._finished(seq):
            self._join(seq, caches)

    def add_step_hops(self, seqs) -> None:
        """(Rank 0 of a pipeline) The hops of the forward that just landed, added to each of its sequences."""
        from ..pipeline.driver import add_hops

        for seq in seqs:
            seq.pp_hops = seq.pp_hops or []
            add_hops(seq.pp_hops, self.pipeline.last)

    def _pick(self, logits, seqs) -> list:
        """The next tokens: chosen here, or (a follower) rank 0's."""
        if self.plan_in is None:
            return choose(self._scores(logits), seqs, self.tokenizer.eos_token_id)
        self.mx.eval(logits)  # the forward (and its all-reduces) runs when evaluated
        msg = self._expect("mlx_chosen")
        self._done = set(msg["done"])
        return [TokenChoice(t) for t in msg["tokens"]]

    def _chosen(self, seqs) -> None:
        self._tell("mlx_chosen", tokens=[s.output_ids[-1] for s in seqs], done=[s.rid for s in seqs if s.finished])

    def _finished(self, seq) -> bool:
        return seq.finished or seq.rid in self._done

    def _tell(self, op: str, **fields) -> None:
        if self.plan is not None:
            self.plan.send(op, **fields)

    def _expect(self, op: str) -> dict:
        msg = self.plan_in.recv(600_000)
        if msg is None or msg["op"] != op:
            raise RuntimeError(f"rank {self.group.rank}: expected {op} from rank 0, got {msg and msg['op']}")
        return msg

    def free(self, seq: Sequence) -> None:
        seq.freed = True
        self._tell("mlx_free", rid=seq.rid)
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        self.micro.drop(seq)  # first: what it is in flight with lands
        self.mirrors.pop(seq.rid, None)
        self.caches.pop(seq.rid, None)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def gather_prompt(self, seq: Sequence, skip_tokens: int = 0) -> list:
        """The prompt's KV after ``skip_tokens`` as MLX arrays in the canonical layout (one copy: the transpose),
        evaluated; transports take them as they are (mlx) or as views of their memory."""
        return self.kv_out(seq, skip_tokens, len(seq.prompt_ids))

    def set_aside(self, seq: Sequence) -> None:
        """Out of the decode batch with its KV kept (a move pauses it): its rows copied out into caches of its own,
        as a prompt's are (``mlx_park`` on every rank; ``take_back`` puts it back)."""
        self._tell("mlx_park", rid=seq.rid)
        self._park(seq)

    def take_back(self, seq: Sequence) -> None:
        self._tell("mlx_unpark", rid=seq.rid)
        self._unpark(seq)

    def kv_out(self, seq: Sequence, start: int, end: int, into=None) -> list:
        """The KV of tokens ``[start, end)`` of a sequence set aside, as ``gather_prompt`` gives a prompt's."""
        self._tell("mlx_gather", rid=seq.rid, skip=start, end=end)
        return self._gather(seq, start, end)

    def holds_token(self, seq: Sequence) -> bool:
        """A token of ``seq`` chosen but not yet handed out (landed outside a step, in a pipeline)."""
        return self.micro.holds_token(seq)

    def _park(self, seq: Sequence) -> None:
        caches = self.micro.take_out(seq)
        if caches is not None:
            self.caches[seq.rid] = caches

    def _unpark(self, seq: Sequence) -> None:
        caches = self.caches.pop(seq.rid, None)
        if caches is not None:
            self._join(seq, caches)

    def _gather(self, seq: Sequence, start: int, end: int) -> list:
        mx = self.mx
        self.micro.drain()  # the gather below uses the ring
        heads = [(c.keys[0, :, start:end, :], c.values[0, :, start:end, :]) for c in self.caches[seq.rid]]
        if self.pipeline is not None:  # every rank's layers, in layer order
            heads = self.pipeline.gather(heads)
        elif self.group.size > 1:  # every rank's heads, in rank order
            heads = [tuple(mx.distributed.all_gather(a, group=self.group.group) for a in kv) for kv in heads]
        out = [tuple(mx.contiguous(a.transpose(1, 0, 2)) for a in kv) for kv in heads]
        mx.eval(out)
        return out

    def release(self, table) -> None:
        pass

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing otherwise)."""
        if self.plan is not None:
            from ..parallel.launch import stop_group

            stop_group(self.group)
