"""Continuous batching over the paged KV pool.

Each step takes, within a token budget: one token for every running
sequence that decodes, the next chunk of every running sequence that is
still prefilling (prompts longer than the budget go in chunks), then new
sequences from the waiting queue while blocks and the sequence limit allow.
While any running sequence decodes, prompt tokens (chunks and new
prompts) are capped at ``prefill_cap`` as well (``step_budget``: a step's
prompt tokens lengthen every decoding sequence's time per token).
When a running sequence needs a block and none is free, the newest running
sequence is preempted: its blocks are freed and it waits at the head of the
queue to be recomputed (its prompt and the tokens generated so far). A
sequence that cannot fit even alone is refused.

With the prefix cache, a sequence admitted from the queue first takes the
cached blocks of its longest cached prefix and computes only the rest; when
its whole prompt is cached, the last block is copied (``Batch.copies``, done
before the forward) and only the last token is computed into the copy."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import kvcache

from .blocks import BlockManager
from .prefix_hash import extend_hashes
from .sequence import Sequence


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    refused: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple] = field(default_factory=list)  # ((tier, slot), block): KV loaded back before the step
    loaded: list = field(default_factory=list)  # the sequences those loads are for
    decode_rows: int = 0  # sequences this step advances by one generated token

    def add(self, seq: Sequence, chunk: int) -> None:
        self.seqs.append(seq)
        self.chunks.append(chunk)

    def samples(self, i: int) -> bool:
        return self.seqs[i].num_computed + self.chunks[i] == self.seqs[i].num_tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int, salt: str = ""):
        self.blocks = blocks
        self.salt = salt
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefill_cap: int | None = None  # prompt tokens of a step that also decodes (None: budget only)
        self.busy: set | None = None  # id() of sequences whose token a pipeline has in flight: not scheduled
        self.pinned: dict | None = None  # id() of every sequence a pipeline has in flight: not preempted
        self.row_cap: int | None = None  # sequences a step takes at most (a pipeline's micro-batch share)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (received from prefill)."""
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, aborted or failed), keeping its blocks (the caller releases them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.num_computed = seq.registered = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> Batch:
        with self.blocks.lock:
            return self._schedule()

    def _schedule(self) -> Batch:
        batch, budget = Batch(), self.max_batched_tokens
        prompt_left = self._prompt_tokens_left()
        rows_left = self.row_cap or self.max_num_seqs
        for seq in list(self.running):
            if budget == 0 or len(batch.seqs) >= rows_left:
                break
            if seq not in self.running or (seq.pending and seq.capped):  # capped: ends when its held token is read
                continue
            if self.busy and id(seq) in self.busy:
                continue
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            decodes = chunk == 1 and seq.num_output > 0
            if not decodes:
                chunk = min(chunk, prompt_left)
                if chunk == 0:
                    continue
                prompt_left -= chunk
            if not self._make_room(seq, seq.num_computed + chunk, batch):
                continue
            self.blocks.grow(seq.block_table, seq.num_computed + chunk)
            batch.add(seq, chunk)
            batch.decode_rows += decodes
            budget -= chunk
        while (self.waiting and budget and prompt_left and len(self.running) < self.max_num_seqs
               and len(batch.seqs) < rows_left):
            seq = self.waiting[0]
            if self.blocks.blocks_for(seq.num_tokens + 1) > self.blocks.num_blocks:
                self.waiting.popleft()
                batch.refused.append(seq)
                continue
            hits = self._cached_prefix(seq)
            plan = self._plan(seq, hits, [], budget, prompt_left)
            if not plan[2]:
                break  # blocks from the tiers would need as many new blocks or more: look there only if it fits
            slots = self._lower_prefix(seq, hits)
            computed, chunk, fits = self._plan(seq, hits, slots, budget, prompt_left) if slots else plan
            if not fits:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.scheduled_at = seq.scheduled_at or time.perf_counter()
            if hits:
                self._reuse(seq, hits, min(computed, len(hits) * self.blocks.block_size), batch)
            if slots:
                self._load(seq, slots, batch)
            self.blocks.grow(seq.block_table, seq.num_computed + chunk)
            batch.add(seq, chunk)
            budget -= chunk
            prompt_left -= chunk
        return batch

    def _plan(self, seq: Sequence, hits: list[int], slots: list, budget: int, prompt_left: int) -> tuple:
        """``(computed, chunk, fits)`` of admitting ``seq`` on the pool's ``hits`` and the tiers' ``slots``: the
        tokens it starts with, its first chunk, and whether the free blocks hold what that needs."""
        bs, cached = self.blocks.block_size, len(hits) + len(slots)
        computed = min(cached * bs, seq.num_tokens - 1) if cached else seq.num_computed
        chunk = min(seq.num_tokens - computed, budget, prompt_left)
        shared = min(len(hits), computed // bs) if cached else len(seq.block_table)
        return computed, chunk, self.blocks.blocks_for(computed + chunk) - shared <= (self.blocks.num_free
                                                                                      - self._idle_among(hits))

    def _prompt_tokens_left(self) -> int:
        """Prompt tokens this step may take: ``prefill_cap`` while a running sequence decodes, else the budget."""
        if self.prefill_cap is None or not any(s.num_output and s.num_tokens - s.num_computed == 1
                                               for s in self.running):
            return self.max_batched_tokens
        return max(1, self.prefill_cap)

    def keys(self, seq: Sequence, tokens: int) -> list[int]:
        """Prefix-cache keys of the first full blocks of ``seq`` covering at most ``tokens`` tokens."""
        return extend_hashes(seq.block_keys, seq.tokens(0, tokens), self.blocks.block_size, self.salt)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self._cached_prefix_allowed(seq):
            return []
        return self.blocks.match(self.keys(seq, seq.num_tokens))

    def _lower_prefix(self, seq: Sequence, hits: list[int]) -> list[int]:
        """The tiers' ``(tier, slot)`` of the full blocks that follow the pool's ``hits`` (a token left to compute)."""
        lower, remote, bs = self.blocks.lower, self.blocks.remote, self.blocks.block_size
        room = (seq.num_tokens - 1) // bs - len(hits)
        if (lower is None and remote is None) or room <= 0 or not self._cached_prefix_allowed(seq):
            return []
        start, keys = time.perf_counter(), self.keys(seq, seq.num_tokens)[len(hits):len(hits) + room]
        found = lower.match(keys) if lower is not None else []
        if remote is not None and len(found) < len(keys):
            found += remote.match(keys[len(found):])
        seq.tier_fetch_ms = (time.perf_counter() - start) * 1e3 if found else None
        return found

    def _cached_prefix_allowed(self, seq: Sequence) -> bool:
        return self.blocks.caching and not (seq.num_computed or seq.block_table
                                            or seq.params.prompt_logprobs is not None)

    def _load(self, seq: Sequence, slots: list[tuple], batch: Batch) -> None:
        """Continue ``seq`` on new blocks that the tier's ``slots`` are loaded into before this step; registered in
        the prefix cache at once (the loads are queued before anything reads them)."""
        bs, start = self.blocks.block_size, len(seq.block_table)
        kvcache.pin(slots)
        keys = self.keys(seq, (start + len(slots)) * bs)
        self.blocks.grow(seq.block_table, (start + len(slots)) * bs)
        batch.loaded.append(seq)
        for i, slot in enumerate(slots):
            batch.loads.append((slot, seq.block_table[start + i]))
            self.blocks.register(seq.block_table[start + i], keys[start + i])
        seq.num_computed = seq.cached_tokens = (start + len(slots)) * bs
        seq.registered = start + len(slots)
        seq.cached_by_tier = {"gpu": start * bs}
        for tier, _ in slots:
            seq.cached_by_tier[tier.name] = seq.cached_by_tier.get(tier.name, 0) + bs

    def _idle_among(self, blocks: list[int]) -> int:
        """Of these cached blocks, how many count as free now (taking them makes them not free)."""
        return sum(1 for b in blocks if self.blocks.refs[b] == 0)

    def _reuse(self, seq: Sequence, hits: list[int], computed: int, batch: Batch) -> None:
        """Start ``seq`` on its cached blocks; a fully cached prompt gets a copy of its last block to compute into."""
        bs = self.blocks.block_size
        shared = hits[:computed // bs]
        seq.block_table = self.blocks.take(shared)
        if len(shared) < len(hits):  # held until the copy is made (so it cannot be evicted for the copy itself)
            source = self.blocks.take([hits[len(shared)]])[0]
            self.blocks.grow(seq.block_table, len(hits) * bs)
            batch.copies.append((source, seq.block_table[-1]))
        seq.num_computed = seq.cached_tokens = computed
        seq.registered = len(shared)
        seq.cached_by_tier = {"gpu": computed}

    def _make_room(self, seq: Sequence, tokens: int, batch: Batch) -> bool:
        while not self.blocks.can_grow(seq.block_table, tokens):
            victims = [s for s in reversed(self.running) if s is not seq and s not in batch.seqs
                       and not (self.pinned and id(s) in self.pinned)]
            if victims:
                self.preempt(victims[0])
            else:
                self.preempt(seq)
                return False
        return True
