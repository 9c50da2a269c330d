"""Runs one scheduled batch: packs the new tokens of every sequence, their
positions and KV slots, calls the model once over the pool, and returns the
next-token scores of the sequences that sample this step (plus, for requests
that asked for prompt logprobs, the scores of every prompt position)."""
from __future__ import annotations

import torch

from .attention import AttnMeta, build_meta, token_slot
from .kv_pool import KVPool
from .scheduler import Batch


class ModelRunner:
    def __init__(self, model, pool: KVPool, device, suppress: list[int] | None = None, graphs=None):
        self.model = model
        self.pool = pool
        self.device = device
        self.suppress = torch.tensor(suppress, device=device) if suppress else None
        self.window = model.spec.sliding_window
        self.graphs = graphs
        self.half_on_cuda = torch.device(device).type == "cuda" and pool.layers[0][0].dtype in (torch.float16,
                                                                                                 torch.bfloat16)

    def _meta(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
        bs = self.pool.block_size
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq, chunk in zip(batch.seqs, batch.chunks):
            start, end = seq.num_computed, seq.num_computed + chunk
            ids += seq.tokens(start, end)
            pos = range(start, end)
            positions += pos
            table = seq.block_table
            slots += [token_slot(table, p, bs) for p in pos]
            starts.append(starts[-1] + chunk)
            lens.append(end)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) + [n] for s, n in zip(batch.seqs, lens)]
        packed = torch.tensor([ids, positions, slots], dtype=torch.long).to(self.device, non_blocking=True)
        tables = torch.tensor(tables, dtype=torch.long).to(self.device, non_blocking=True)
        rotary = self.model.rotary
        cos, sin = rotary.cos[packed[1]], rotary.sin[packed[1]]
        meta = build_meta(packed[2], starts, lens, tables[:, :-1], tables[:, -1], bs, self.window, cos, sin,
                          self.half_on_cuda)
        return packed[0], packed[1], meta

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden).float()
        if self.suppress is not None:
            logits[..., self.suppress] = float("-inf")
        return logits

    @torch.inference_mode()
    def run(self, batch: Batch, on_layer=None) -> tuple[torch.Tensor, dict]:
        """``(scores of the sampling sequences in batch order, {batch index: prompt-position scores})``.
        With ``graphs``, the decode rows go through the captured step and the rest (prompt chunks) eagerly.
        ``on_layer(i)``: called as the eager forward finishes each layer."""
        decode = [i for i in range(len(batch.seqs)) if self._decodes(batch, i)] if self.graphs is not None else []
        if not decode or not self.graphs.fits(len(decode)):
            return self._run_eager(batch, on_layer)
        graph_scores = self._run_graph([batch.seqs[i] for i in decode])
        decode = set(decode)
        if len(decode) == len(batch.seqs):
            return graph_scores, {}
        rest, index = Batch(), []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            if i not in decode:
                rest.add(seq, chunk)
                index.append(i)
        eager_scores, rest_prompt = self._run_eager(rest, on_layer)
        rows, g, e = [], iter(graph_scores), iter(eager_scores)
        for i in range(len(batch.seqs)):
            if i in decode:
                rows.append(next(g))
            elif batch.samples(i):
                rows.append(next(e))
        return torch.stack(rows), {index[j]: v for j, v in rest_prompt.items()}

    def _run_eager(self, batch: Batch, on_layer=None) -> tuple[torch.Tensor, dict]:
        ids, positions, meta = self._meta(batch)
        meta.on_layer = on_layer
        hidden = self.model(ids, positions, meta, self.pool.layers)
        rows, prompt_scores = [], {}
        for i, seq in enumerate(batch.seqs):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            if seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids):
                prompt_scores[i] = self._scores(hidden[start:end])
            if batch.samples(i):
                rows.append(end - 1)
        scores = self._scores(hidden[rows]) if rows else hidden.new_empty((0, 0))
        return scores, prompt_scores

    @staticmethod
    def _decodes(batch: Batch, i: int) -> bool:
        """One new token that samples and needs no prompt scores: what the captured decode step computes."""
        seq = batch.seqs[i]
        wants_prompt = seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids)
        return batch.chunks[i] == 1 and batch.samples(i) and not wants_prompt

    def _run_graph(self, seqs: list) -> torch.Tensor:
        bs = self.pool.block_size
        ids, positions, slots, lens = [], [], [], []
        for seq in seqs:
            p = seq.num_computed
            ids += seq.tokens(p, p + 1)
            positions.append(p)
            slots.append(token_slot(seq.block_table, p, bs))
            lens.append(p + 1)
        logits = self.graphs.run(ids, positions, slots, [s.block_table for s in seqs], lens).clone()
        if self.suppress is not None:
            logits[:, self.suppress] = float("-inf")
        return logits
