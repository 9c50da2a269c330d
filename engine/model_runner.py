"""Runs one scheduled step: packs the new tokens of every row, their
positions and KV slots, calls the model once over the pool, and returns the
next-token scores of the rows that sample this step (plus, for requests
that asked for prompt logprobs, the scores of every prompt position).

A step is a list of ``StepRow`` (``step_rows`` makes them from a scheduled
batch): plain data, so rank 0 of a tensor-parallel group sends the same
rows to every other rank and all run the same forward.

Where the engine captured CUDA graphs: a step of decodes only replays its
decode graph (``cuda_graphs.decode``); prompt chunks alone replay a prompt graph
(``cuda_graphs.prompt``) where one takes them; decode rows with prompt chunks (and
prompt chunks no prompt graph takes) replay a mixed-step graph chosen by their token
count (``cuda_graphs.mixed``); the rest
(prompt logprobs, layer-by-layer progress, steps past the graphs) as one eager
forward, decode rows first."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttnMeta, build_meta, token_slot
from .kv_pool import KVPool
from .scheduler import Batch
from .sequence import PENDING

@dataclass
class StepRow:
    ids: list  # the new tokens of one sequence this step
    start: int  # the position of the first of them
    table: list  # the sequence's block table
    samples: bool  # the step ends the sequence's known tokens: its next token is chosen
    prompt_scores: bool  # the scores of every position are wanted (prompt logprobs)
    feed: int = -1  # the input token is still on the device: this row of the step in flight (engine.overlap)

    def to_wire(self) -> list:
        return [self.ids, self.start, self.table, self.samples, self.prompt_scores, self.feed]


def step_rows(batch: Batch, inflight_rows: dict | None = None) -> list[StepRow]:
    """``inflight_rows``: ``{id(sequence): row}`` of the step in flight, for inputs held there."""
    rows = []
    for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
        start = seq.num_computed
        wants = seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids)
        row = StepRow(seq.tokens(start, start + chunk), start, seq.block_table, batch.samples(i), wants)
        if seq.pending and row.ids[-1] == PENDING:
            row.feed = inflight_rows[id(seq)]
        rows.append(row)
    return rows


@dataclass
class DecodeRows:
    """What landing a pipeline's captured decode step needs of its meta: where each row's tokens start."""
    query_starts: list


class ModelRunner:
    def __init__(self, model, pool: KVPool, device, suppress: list[int] | None = None, graphs=None):
        self.model = model
        self.pool = pool
        self.device = device
        self.suppress = torch.tensor(suppress, device=device) if suppress else None
        self.window = model.spec.sliding_window
        self.graphs = graphs
        self.half_on_cuda = torch.device(device).type == "cuda" and next(model.parameters()).dtype in (
            torch.float16, torch.bfloat16)

    def _meta(self, rows: list[StepRow], decode_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
        bs = self.pool.block_size
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for row in rows:
            end = row.start + len(row.ids)
            ids += row.ids
            pos = range(row.start, end)
            positions += pos
            slots += [token_slot(row.table, p, bs) for p in pos]
            starts.append(starts[-1] + len(row.ids))
            lens.append(end)
        width = max(len(r.table) for r in rows)
        tables = [list(r.table) + [0] * (width - len(r.table)) + [n] for r, n in zip(rows, lens)]
        packed = torch.tensor([ids, positions, slots], dtype=torch.long).to(self.device, non_blocking=True)
        tables = torch.tensor(tables, dtype=torch.long).to(self.device, non_blocking=True)
        rotary = self.model.rotary
        cos, sin = rotary.cos[packed[1]], rotary.sin[packed[1]]
        meta = build_meta(packed[2], starts, lens, tables[:, :-1], tables[:, -1], bs, self.window, cos, sin,
                          self.half_on_cuda, decode_rows, self.graphs.ops if decode_rows else None)
        return packed[0], packed[1], meta

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden).float()
        if self.suppress is not None:
            logits[..., self.suppress] = float("-inf")
        return logits

    @torch.inference_mode()
    def run(self, rows: list[StepRow], on_layer=None, feed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``(scores of the sampling rows in order, {row index: prompt-position scores})``.
        With ``graphs``: as the module says. ``on_layer(i)``: called as the eager forward finishes each layer. ``feed``: the device tokens of the step
        in flight, which rows with a ``feed`` index take as input (only through the graphs)."""
        decode = [i for i, r in enumerate(rows) if self.decodes(r)] if self.graphs is not None else []
        if len(decode) == len(rows) and self.graphs.fits(len(decode)):
            return self._run_graph(rows, feed), {}
        self._no_feed(rows)
        if not decode and on_layer is None and self._prompt_graph_takes(rows):
            return self._run_prompt_graph(rows), {}
        if on_layer is None and self._mixed_graph_takes(rows):
            return self._run_mixed_graph(rows), {}
        taken = set(decode)
        order = decode + [i for i in range(len(rows)) if i not in taken]
        scores, prompt = self._run_eager([rows[i] for i in order], on_layer, len(decode))
        if order == list(range(len(rows))):
            return scores, prompt
        by_row = dict(zip([i for i in order if rows[i].samples], scores))
        picked = [by_row[i] for i in range(len(rows)) if rows[i].samples]
        return (torch.stack(picked) if picked else scores[:0]), {order[j]: v for j, v in prompt.items()}

    def _mixed_graph_takes(self, rows: list[StepRow]) -> bool:
        """Rows the mixed-step graphs (``cuda_graphs.mixed``) take: no prompt scores, few enough tokens."""
        mixed = getattr(self.graphs, "mixed", None)
        if mixed is None or any(r.prompt_scores for r in rows):
            return False
        return mixed.fits(sum(len(r.ids) for r in rows), len(rows))

    def _run_mixed_graph(self, rows: list[StepRow]) -> torch.Tensor:
        """The scores of the sampling rows of ``rows`` through the mixed-step graphs."""
        bs, ids, positions, slots, query_starts = self.pool.block_size, [], [], [], [0]
        for row in rows:
            pos = range(row.start, row.start + len(row.ids))
            ids += row.ids
            positions += pos
            slots += [token_slot(row.table, p, bs) for p in pos]
            query_starts.append(query_starts[-1] + len(row.ids))
        logits = self.graphs.mixed.run(ids, positions, slots, [list(r.table) for r in rows], query_starts,
                                       [r.start for r in rows])
        logits = logits[[i for i, r in enumerate(rows) if r.samples]]  # a copy (advanced indexing)
        if self.suppress is not None:
            logits[:, self.suppress] = float("-inf")
        return logits

    def _run_eager(self, rows: list[StepRow], on_layer=None, decode_rows: int = 0) -> tuple[torch.Tensor, dict]:
        ids, positions, meta = self._meta(rows, decode_rows)
        meta.on_layer = on_layer
        hidden = self.model(ids, positions, meta, self.pool.layers)
        return self.pick_scores(hidden, rows, meta)

    @torch.inference_mode()
    def stage_forward(self, rows: list[StepRow], x: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """A pipeline stage's part of the forward of ``rows``: from their token ids (``x`` None: stage 0) or the
        residual stream ``x`` of the stage before; ``(the stream after this stage's layers, the step's meta)``."""
        if self.graphs is not None and all(self.decodes(r) for r in rows) and self.graphs.fits(len(rows)):
            bs, positions = self.pool.block_size, [r.start for r in rows]
            out = self.graphs.run([max(r.ids[0], 0) for r in rows], positions,
                                  [token_slot(r.table, r.start, bs) for r in rows], [list(r.table) for r in rows],
                                  [p + 1 for p in positions], x=x)
            return out, DecodeRows(list(range(len(rows) + 1)))  # one token a row
        ids, positions, meta = self._meta(rows)
        return self.model.stage_forward(ids if x is None else x, positions, meta, self.pool.layers), meta

    @torch.inference_mode()
    def pick_scores(self, hidden: torch.Tensor, rows: list[StepRow], meta) -> tuple[torch.Tensor, dict]:
        """``(scores of the sampling rows, {row index: prompt-position scores})`` from the step's final hidden."""
        picked, prompt_scores = [], {}
        for i, row in enumerate(rows):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            if row.prompt_scores:
                prompt_scores[i] = self._scores(hidden[start:end])
            if row.samples:
                picked.append(end - 1)
        scores = self._scores(hidden[picked]) if picked else hidden.new_empty((0, 0))
        return scores, prompt_scores

    @staticmethod
    def _no_feed(rows: list[StepRow]) -> None:
        if any(r.feed >= 0 for r in rows):
            raise RuntimeError("a token held on the device fed to the eager path (engine.overlap checks prevent it)")

    @staticmethod
    def decodes(row: StepRow) -> bool:
        """One new token that samples and needs no prompt scores: what the captured decode step computes."""
        return len(row.ids) == 1 and row.samples and not row.prompt_scores

    def _prompt_graph_takes(self, rows: list[StepRow]) -> bool:
        """Prompt chunks that want no prompt scores and have a graph (``cuda_graphs.prompt``): fresh ones and
        ones after cached prefixes, packed together."""
        prompts = getattr(self.graphs, "prompts", None)
        if prompts is None or not rows or any(r.prompt_scores for r in rows):
            return False
        return prompts.shape_for([len(r.ids) for r in rows], [r.start for r in rows]) is not None

    def _run_prompt_graph(self, rows: list[StepRow]) -> torch.Tensor:
        """The scores of the sampling rows among ``rows`` (which ``_prompt_graph_takes``)."""
        bs = self.pool.block_size
        slots = [[token_slot(r.table, p, bs) for p in range(r.start, r.start + len(r.ids))] for r in rows]
        logits = self.graphs.prompts.run([r.ids for r in rows], [r.start for r in rows], slots,
                                         [list(r.table) for r in rows])
        logits = logits[[i for i, r in enumerate(rows) if r.samples]]  # a copy (advanced indexing)
        if self.suppress is not None:
            logits[:, self.suppress] = float("-inf")
        return logits

    def _run_graph(self, rows: list[StepRow], feed: torch.Tensor | None = None) -> torch.Tensor:
        bs = self.pool.block_size
        positions = [r.start for r in rows]
        slots = [token_slot(r.table, r.start, bs) for r in rows]
        fed = (feed, [r.feed for r in rows]) if any(r.feed >= 0 for r in rows) else None
        logits = self.graphs.run([max(r.ids[0], 0) for r in rows], positions, slots, [list(r.table) for r in rows],
                                 [p + 1 for p in positions], fed).clone()
        if self.suppress is not None:
            logits[:, self.suppress] = float("-inf")
        return logits
