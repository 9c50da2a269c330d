"""The engine both worker kinds share: a model, its paged KV pool, a block
manager and a scheduler, advanced one batched step at a time.

``add`` queues a new prompt; ``add_prefilled`` starts a sequence whose
prompt KV came from elsewhere (a prefill worker) by writing it into fresh
blocks; ``step`` runs one batch and returns each sequence's new text.
With ``hold_after_first`` (prefill workers; or a sequence's own flag, the
prompts a mixed worker prefills for others) a sequence leaves the scheduler
after its first token with its blocks kept, so its KV can be sent, then
``free`` returns them."""
from __future__ import annotations

import logging
import os
import time

import torch

from kvcache import attach as attach_tiers, load as load_tiers
from kvcache.mirror import Echo
from .blocks import BlockManager
from .config import EngineConfig
from .kv_pool import KVPool, free_memory
from .decode_path import engine_graphs
from .emitted import Emitted
from .loader import load, rank_device
from .model_runner import ModelRunner, step_rows
from .models.llama import use_fp8_kv
from .quant import kv_fp8
from .parallel.group import SINGLE, TPGroup
from . import overlap
from .sampler import choose_later
from .scheduler import Scheduler
from .guided.grammars import engine_guides
from .step_budget import PrefillBudget, StepLog, StepRecord, decoding_rows
from .sequence import Sequence
from .step_output import StepOutput, add_prompt_logprobs

log = logging.getLogger(__name__)
CPU_DEFAULT_BUDGET = int(os.environ.get("PDSERVE_CPU_KV_MIB", "2048")) << 20  # a CPU pool's size without --kv-budget


class Engine:
    def __init__(self, cfg: EngineConfig, hold_after_first: bool = False, pool_memory=None,
                 group: TPGroup | None = None, device=None, tp_kv: str | None = None, stage=None):
        """``pool_memory(nbytes, device)``: where the KV pool lives (a zeroed uint8 tensor on ``device``, or None
        for memory of its own). With ``cfg.tp > 1`` and no ``group`` this is rank 0: it starts the other ranks
        (``parallel.launch``; ``tp_kv``: their KV work) and sends them every step; a follower passes its
        ``group`` and ``device``. With ``cfg.pp > 1`` and no ``stage`` this is stage 0 of a pipeline
        (``engine.pipeline``): it starts the other stages and drives them; a later stage passes its ``stage``."""
        self.cfg = cfg
        if group is None and cfg.tp > 1:
            from .parallel.launch import start_group

            device = rank_device(cfg.device, 0, cfg.tp)
            group = start_group(cfg, device, tp_kv)
        if stage is None and cfg.pp > 1:
            from .pipeline.driver import Pipeline

            device, stage = rank_device(cfg.device, 0, cfg.pp), Pipeline(cfg, tp_kv)
        self.group, self.stage = group or SINGLE, stage
        loaded = load(cfg, self.group, device, stage.span if stage is not None else None)
        self.model, self.tokenizer, self.name = loaded.model, loaded.tokenizer, loaded.name
        self.max_len, self.device, self.dtype = loaded.max_len, loaded.device, loaded.dtype
        self.quantization = loaded.quantization
        if self.device.type == "cuda":  # cuDNN attention plans each new shape anew: every prompt length would pay it
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.cuda.set_device(self.device)  # kernels launched by Triton go to the current device
            if self.group.size > 1:  # every rank gets here at the same point: this is a collective
                from .parallel.allreduce import one_shot

                self.group.one_shot = one_shot(self.group.group, self.dtype, self.device)
                if self.dtype == torch.bfloat16:
                    from .parallel.allreduce import pushed_slots

                    self.group.pushed = pushed_slots(self.group.group, self.model.spec.hidden_size,
                                                     self.model.span[1] - self.model.span[0], self.device)
        spec = self.model.spec
        self.heads = self.model.heads  # this rank's attention and KV heads (all of them without TP)
        layers = self.model.span[1] - self.model.span[0]  # this stage's (all of them without a pipeline)
        self.kv_shape = (layers, self.heads.kv_heads, spec.head_dim)  # this rank's
        self.model_kv_shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)  # the model's, all ranks together
        self.kv_dtype = kv_fp8.kv_dtype(cfg.kv_cache_dtype, self.dtype)  # what the pool stores
        kv_scales = use_fp8_kv(self.model, self.kv_dtype == kv_fp8.FP8)
        self.kv_bytes_per_token = 2 * layers * self.heads.kv_heads * spec.head_dim * self.kv_dtype.itemsize
        self.block_size = cfg.block_size
        blocks = cfg.num_blocks or self._default_blocks(cfg)
        if stage is not None:  # every stage of a pipeline holds the same blocks
            blocks = stage.agree_blocks(self, blocks)
        self.num_blocks = self.group.min_int(blocks, self.device)
        if not cfg.num_blocks:
            self._fit_context()
        memory = pool_memory(self.num_blocks * self.block_bytes, self.device) if pool_memory else None
        self.pool = KVPool(layers, self.num_blocks, self.block_size, self.heads.kv_heads, spec.head_dim,
                           self.kv_dtype, self.device, memory, kv_scales)
        self.kv_scales = self.pool.scales  # FP8: (k_scale, v_scale) per layer; None otherwise
        self.blocks = BlockManager(self.num_blocks, self.block_size, caching=cfg.prefix_caching)
        self.tiers = self._attach_tiers(cfg, spec.num_layers / layers)
        budget = cfg.max_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, budget, salt=self.name)
        self.prefill_budget = PrefillBudget(budget, self.block_size, cfg.step_prefill_tokens, cfg.slo_tpot_ms)
        self.scheduler.prefill_cap = self.prefill_budget.tokens()
        self.step_log = StepLog()
        self.profiler, self._last_step_end = None, None  # the worker's step profiler; when the last busy step ended
        self.prompt_tokens = self.cached_tokens = self.prefix_hits = 0
        self.runner = ModelRunner(self.model, self.pool, self.device, loaded.suppress, engine_graphs(self, cfg))
        self.suppress = self.runner.suppress
        self.hold_after_first = hold_after_first
        self.on_schedule = None  # called with each batch before its forward runs; may return a LayerProgress
        self.inflight: overlap.InFlight | None = None  # a decode step still on the device (``overlap``)
        self.overlapped = 0  # steps left on the device while the next was prepared (``overlap``)
        self.shared_tokens = None  # (a follower rank) rank 0's tokens of the step before, on the device
        log.info("KV pool: %d blocks of %d tokens, %s (%.1f MiB)", self.num_blocks, self.block_size,
                 str(self.kv_dtype).removeprefix("torch."),
                 self.num_blocks * self.block_bytes / 2**20)

    guides = property(engine_guides)  # grammars of structured outputs over this engine's vocabulary

    def step_info(self) -> dict:
        """The prompt-token cap of steps that decode, the most prompt tokens such a step took, and the steps that
        stayed on the device while the next was launched (``overlap``)."""
        return {**self.prefill_budget.info(), "mixed_steps": self.step_log.mixed_steps,
                "step_prompt_tokens_max": self.step_log.most_prompt_tokens_while_decoding,
                "steps_ahead": self.overlapped, "step_times": self.step_log.info()}

    def prefix_info(self) -> dict:
        """What a worker reports about its prefix cache (and what the router needs to compute its keys)."""
        return {"tokenizer": self.cfg.tokenizer_source, "kv_block_size": self.block_size,
                "prefix_caching": self.blocks.caching, "prefix_cached_blocks": self.blocks.num_cached,
                "prefix_prompt_tokens": self.prompt_tokens, "prefix_cached_tokens": self.cached_tokens,
                "prefix_hits": self.prefix_hits, "vocab_size": self.tokenizer.vocab_size,
                **self.tiers.info()}

    def _attach_tiers(self, cfg: EngineConfig, stages: float):
        """The tiers under the pool (``kvcache``), sized for the worker's ranks together; with several ranks, rank 0
        sends its host tier's copies on the plan and the others mirror them (``kvcache.mirror``)."""
        drives = getattr(self.stage, "drives", False)  # stage 0 of a pipeline
        follower = self.group.rank > 0 or (self.stage is not None and not drives)
        plan = self.stage.stages.plan if drives else self.group.plan
        whole = round(self.block_bytes * self.group.size * stages)
        return attach_tiers(self.pool.stacked, self.blocks, whole, cfg, self.name,
                            echo=Echo(plan.send) if plan is not None and not follower else None, follower=follower)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def _default_blocks(self, cfg: EngineConfig) -> int:
        """The budget given, else enough for ``max_num_seqs`` full-context sequences, at most half the free memory
        (and on the CPU at most ``CPU_DEFAULT_BUDGET``)."""
        budget = cfg.kv_budget_bytes
        if not budget:
            whole = cfg.max_num_seqs * self.max_len * self.kv_bytes_per_token
            free = free_memory(self.device)
            budget = min(whole, free // 2)
            if self.device.type == "cpu":
                budget = min(budget, CPU_DEFAULT_BUDGET)
            elif self.device.type == "cuda":
                log.info("KV pool on %s: %.1f GiB free (%.1f allocated), %.1f wanted: %.1f GiB", self.device,
                         free / 2**30, torch.cuda.memory_allocated(self.device) / 2**30, whole / 2**30, budget / 2**30)
        return max(budget // self.block_bytes, 2)

    def _fit_context(self) -> None:
        """Limit the context to what the pool holds (a sequence needs its blocks plus one)."""
        least = -(-self.max_len // self.block_size) + 1
        if self.num_blocks < least:
            fits = max(2, (self.num_blocks - 1) * self.block_size)
            log.warning("the KV pool holds %d blocks: context limited to %d tokens (of %d); give a larger "
                        "--kv-budget or a smaller --max-model-len", self.num_blocks, fits, self.max_len)
            self.max_len = fits

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence, layers, prefix: list[int] | None = None) -> bool:
        """Start ``seq`` from the KV of every token but its last (canonical layers; after the cached ``prefix``
        blocks when given); False when no blocks are free for it now."""
        prefix = prefix or []
        table = self.reserve(seq.num_tokens - 1 - len(prefix) * self.block_size)
        if table is None:
            return False
        if self.stage is not None:  # stage 0 of a pipeline: its layers here, the others' to them
            layers = self.stage.hand_out(self, table, layers)
        self.pool.scatter(table, layers)
        self.adopt(seq, prefix + table)
        return True

    def reserve(self, tokens: int) -> list[int] | None:
        """Blocks for ``tokens`` tokens of KV that is about to arrive (any thread), or None when too few are free."""
        table: list[int] = []
        with self.blocks.lock:
            if not self.blocks.can_grow(table, tokens + 1):
                return None
            self.blocks.grow(table, tokens)
        self.tiers.settle()  # blocks it evicted are copied out before the caller's stream writes them
        return table

    def pieces(self, table: list[int], tokens: int) -> list:
        """Per layer ``(k_pieces, v_pieces)``: the canonical KV of ``tokens`` tokens as views of these blocks."""
        return self.pool.pieces(table, tokens)

    def rows(self, table: list[int], tokens: int) -> tuple[list, list]:
        """The same KV as ``(flat, spans)``: per layer the flat pool tensors ``(k, v)``, and the rows of them it
        occupies (what ``kvtransfer.pieces.PoolRows`` takes: pieces made on demand, copies by index)."""
        return self.pool.flat, self.pool.spans(table, tokens)

    def adopt(self, seq: Sequence, table: list[int]) -> None:
        """Start ``seq`` whose KV (every token but its last) already sits in ``table`` (received into the blocks)."""
        seq.block_table = table
        seq.num_computed = seq.num_tokens - 1
        self.register(seq)
        self.scheduler.add_running(seq)

    def register(self, seq: Sequence) -> None:
        """Put the blocks ``seq`` has filled since the last call into the prefix cache."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        if not self.blocks.caching or full <= seq.registered:
            return
        keys = self.scheduler.keys(seq, full * self.block_size)
        for i in range(seq.registered, full):
            self.blocks.register(seq.block_table[i], keys[i])
        seq.registered = full

    def cached_prefix(self, keys: list[int]) -> list[int]:
        """Take the cached blocks of the longest prefix of ``keys`` (a new table; release it when done)."""
        with self.blocks.lock:
            return self.blocks.take(self.blocks.match(keys))

    def _count_prefix(self, batch) -> None:
        for seq in batch.seqs:
            if not seq.counted and not seq.output_ids:
                seq.counted = True
                self.prompt_tokens += len(seq.prompt_ids)
                self.cached_tokens += seq.cached_tokens
                self.tiers.count(seq.cached_by_tier)
                self.prefix_hits += seq.cached_tokens > 0

    def release(self, table: list[int]) -> None:
        self.blocks.release(table)

    def free(self, seq: Sequence) -> None:
        """Take ``seq`` out of the engine and return its blocks (idempotent)."""
        seq.freed = True
        self.scheduler.remove(seq)
        self.blocks.release(seq.block_table)

    def gather(self, seq: Sequence, into: list | None = None) -> list:
        return self.pool.gather(seq.block_table, len(seq.prompt_ids), into)

    def set_aside(self, seq: Sequence) -> None:
        """Out of the steps with its KV kept, for a move (``take_back`` puts it back)."""
        self.scheduler.remove(seq)

    def take_back(self, seq: Sequence) -> None:
        self.scheduler.add_running(seq)

    def holds_token(self, seq: Sequence) -> bool:
        """A token of ``seq`` still in a pipeline's flight (it lands, and is handed out, with a later step)."""
        return self.stage is not None and id(seq) in getattr(self.stage, "busy", ())

    def kv_out(self, seq: Sequence, start: int, end: int, into: list | None = None) -> list:
        """The KV of tokens ``[start, end)`` of ``seq`` (``start`` on a block boundary), copied out of the pool."""
        return self.pool.gather(seq.block_table[start // self.block_size:], end - start, into)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None or (self.stage is not None and self.stage.in_flight)

    def step(self) -> StepOutput:
        """One batch: its new tokens, or (``overlap``) those of the step before, while this one runs on; logged
        (``step_log``) and timed for the prompt-token cap of steps that decode (``step_budget``)."""
        if self.profiler is not None:
            self.profiler.before()
        start = time.perf_counter()
        gap = (start - self._last_step_end) * 1e3 if self._last_step_end is not None else None
        if self.prefill_budget.slo_ms is not None:
            self.scheduler.prefill_cap = self.prefill_budget.tokens(
                self.prefill_budget.allowance(decoding_rows(self.scheduler.running, start)))
        out = self._step()
        end = time.perf_counter()
        if self.profiler is not None:
            self.profiler.after(bool(out.scheduled), (end - start) * 1e3)
        self._last_step_end = end if out.scheduled and self.has_work else None  # gaps counted only under work
        self.step_log.read_replays(self.runner.graphs)
        if out.scheduled:
            rows = out.decode_rows
            context = sum(seq.num_tokens for seq in out.scheduled[:rows])
            record = StepRecord(rows, out.batch_tokens - rows, (end - start) * 1e3, context)
            self.step_log.add(record, gap)
            if self.prefill_budget.active:
                self.prefill_budget.observe(record)
        return out

    def _step(self) -> StepOutput:
        if self.stage is not None:  # stage 0 of a pipeline: micro-batches in flight
            return self.stage.step(self)
        out = StepOutput()
        if self.inflight is not None and not overlap.can_follow(self):
            self._read_inflight(out)
        batch = self.scheduler.schedule()
        out.refused, out.scheduled, out.batch_tokens = batch.refused, batch.seqs, batch.num_tokens
        out.decode_rows = batch.decode_rows
        if not batch.seqs:
            if self.inflight is not None:
                self._read_inflight(out)
            return out
        rows = step_rows(batch, self.inflight.rows_of() if self.inflight is not None else None)
        progress = self.on_schedule(batch) if self.on_schedule is not None else None
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        ahead = bool(sampling) and overlap.keeps(self, rows, sampling)
        for source, target in batch.copies:
            self.pool.copy_block(source, target)
            self.blocks.release([source])
        if batch.loads:
            load_tiers(batch.loads, batch.loaded)
        self.tiers.end_step()
        if self.group.plan is not None:  # the other ranks run the same step (after any KV or tier work just sent)
            self.group.plan.step(rows, batch.copies, ahead)
        self._count_prefix(batch)
        feed = self.inflight.choices.device_tokens if self.inflight is not None else None
        scores, prompt_scores = self.runner.run(rows, progress.layer_done if progress is not None else None, feed)
        choices = self._choose(batch, sampling, scores, prompt_scores, ahead, out)
        previous, self.inflight = self.inflight, None
        if ahead:
            places = [None if seq.finished else seq.reserve() for seq in sampling]
            self.inflight = overlap.InFlight(sampling, places, choices)
            self.overlapped += 1
        if previous is not None:
            previous.finish(lambda seq, delta: self._took(seq, delta, out, True))
        if choices is not None and self.inflight is None:
            for seq, choice in zip(sampling, choices.read()):
                if not seq.finished:  # (a guided read of the step before can have ended it)
                    self._took(seq, seq.append(choice), out)
        return out

    def _choose(self, batch, sampling: list, scores, prompt_scores: dict, ahead: bool, out: StepOutput):
        """After the forward: prompt logprobs, computed counts, then the tokens chosen on the device (``Choices``,
        None when no row samples). Under TP with the step ahead the other ranks wait for those tokens to feed their
        next step: they get them, or zeros if choosing failed."""
        choices = None
        try:
            for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
                if i in prompt_scores:
                    add_prompt_logprobs(seq, prompt_scores[i], seq.num_computed, chunk)
                seq.num_computed += chunk
                if not seq.pending:  # a held input token: registered once it is read
                    self.register(seq)
            if self.inflight is not None and any(seq.guide is not None for seq in sampling):
                self._read_inflight(out)  # the masks need its tokens; the device runs this step's forward meanwhile
            choices = choose_later(scores, sampling, self.tokenizer.eos_token_id) if sampling else None
            return choices
        finally:
            if ahead and self.group.size > 1:
                tokens = choices.device_tokens if choices is not None else \
                    torch.zeros(len(sampling), dtype=torch.long, device=self.device)
                self.group.share_tokens(tokens, len(sampling), self.device)

    def _read_inflight(self, out: StepOutput) -> None:
        previous, self.inflight = self.inflight, None
        previous.finish(lambda seq, delta: self._took(seq, delta, out, True))

    def _took(self, seq: Sequence, delta: str, out: StepOutput, held: bool = False) -> None:
        out.tokens.append(Emitted.of(seq, delta))
        if held:
            self.register(seq)
        hold = self.hold_after_first or seq.hold_after_first
        if seq.finished and not hold:
            self.free(seq)
        elif hold:
            self.scheduler.remove(seq)

    def warm_up(self) -> None:
        """Pay the first requests' one-time costs now (``engine.warmup``), unless ``cfg.warmup`` is off."""
        if self.cfg.warmup:
            from .warmup import warm_up

            warm_up(self)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group or the other stages of a pipeline (nothing otherwise)."""
        if self.stage is not None:
            self.stage.close()
        if self.group.plan is not None:
            from .parallel.launch import stop_group

            stop_group(self.group)
