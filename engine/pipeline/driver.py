"""Stage 0 of a pipeline: it schedules, runs the first layers, keeps micro-batches in flight, and samples.

``step`` (in place of ``Engine._step``): while fewer than ``pp`` micro-batches
are in flight, schedule one from the sequences not already in flight (at
most its share of them, so the micro-batches come out even), send its rows
on the plan, run the embedding and this stage's layers and send the
residual stream to stage 1; once ``pp`` are in flight (or nothing more can
be scheduled), take the oldest back from the last stage, apply the final
norm and the LM head, and sample. So with as many micro-batches as stages
every stage works on one while the others work on the rest; prompt chunks
go in micro-batches like decode rows, and a chunk that does not sample lets
the prompt's next chunk follow it at once (a long prompt is pipelined). A
sequence whose token is in flight is not scheduled again, and none in flight
is preempted; every stage handles micro-batches in the order sent, so KV is
written before a later micro-batch reads it, and a block freed and reused
is written after its last reader.
Each sequence accumulates the phases of its micro-batches' hops
(``pp_hops``: per hop, the sum over its steps)."""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

from kvcache import load as load_tiers

from ..model_runner import StepRow, step_rows
from .hops import HopLink
from .launch import Stages, fingerprint, node_address

log = logging.getLogger(__name__)

@dataclass
class Flight:
    tag: str
    batch: object
    rows: list[StepRow]
    meta: object
    starts: list[int]


class Pipeline:
    drives = True

    def __init__(self, cfg, kv: tuple | None = None):
        self.cfg, self.depth = cfg, cfg.pp
        self.stages = Stages(cfg, kv)
        self.span = self.stages.spans[0]
        self.link = None
        self.flights: deque[Flight] = deque()
        self.busy: set[int] = set()  # id() of the sequences whose token is in flight: not scheduled until it lands
        self.pinned: dict[int, int] = {}  # id() of every sequence in flight: micro-batches holding it (not preempted)
        self.tags = itertools.count()
        self.hop_totals: list[dict] = []  # per hop: phases summed over every micro-batch (Prometheus, bench)
        self.most_in_flight = 0  # the most micro-batches that were in the pipeline at once
        self.ready = False  # every stage reported ready (checked before the first micro-batch)

    def agree_blocks(self, engine, blocks: int) -> int:
        self.link = HopLink(self.cfg.pp_transport, self.stages.token, engine.device, host=node_address())
        return self.stages.agree(fingerprint(engine), blocks, self.link.address)

    @property
    def in_flight(self) -> bool:
        return bool(self.flights)

    def step(self, engine):
        from ..step_output import StepOutput

        out, launched = StepOutput(), False
        if not self.ready:
            self.stages.wait_ready()
            self.ready = True
        if len(self.flights) < self.depth:
            batch = self._schedule(engine)
            out.refused = batch.refused
            if batch.seqs:
                self._launch(engine, batch, out)
                launched = True
        if self.flights and (len(self.flights) >= self.depth or not launched):
            self._land(engine, out)
        return out

    def _schedule(self, engine):
        sched = engine.scheduler
        free = len(sched.running) + len(sched.waiting) - len(self.busy)
        sched.busy, sched.pinned = self.busy, self.pinned
        sched.row_cap = max(1, -(-free // (self.depth - len(self.flights))))
        try:
            return sched.schedule()
        finally:
            sched.busy = sched.pinned = sched.row_cap = None

    def _launch(self, engine, batch, out) -> None:
        rows = step_rows(batch)
        tag = f"mb{next(self.tags)}"
        for source, target in batch.copies:
            engine.pool.copy_block(source, target)
            engine.blocks.release([source])
        if batch.loads:
            load_tiers(batch.loads, batch.loaded)
        engine.tiers.end_step()
        self.stages.plan.send("step", rows=[r.to_wire() for r in rows], copies=[list(c) for c in batch.copies],
                              tag=tag)  # after the tier's copies for it (``kvcache.mirror``)
        engine._count_prefix(batch)
        x, meta = engine.runner.stage_forward(rows)
        self.link.send(self.stages.next_address, tag, x, [])
        starts = []
        for seq, chunk in zip(batch.seqs, batch.chunks):
            starts.append(seq.num_computed)
            seq.num_computed += chunk
            engine.register(seq)
        for seq, row in zip(batch.seqs, rows):
            if row.samples:  # a prompt chunk that does not sample lets the next chunk follow it into the pipeline
                self.busy.add(id(seq))
            self.pinned[id(seq)] = self.pinned.get(id(seq), 0) + 1
        self.flights.append(Flight(tag, batch, rows, meta, starts))
        self.most_in_flight = max(self.most_in_flight, len(self.flights))
        out.scheduled, out.batch_tokens, out.decode_rows = batch.seqs, batch.num_tokens, batch.decode_rows

    def _land(self, engine, out) -> None:
        from ..step_output import add_prompt_logprobs
        from ..sampler import choose_later

        flight = self.flights.popleft()
        batch = flight.batch
        self.busy.difference_update(id(s) for s in batch.seqs)
        for seq in batch.seqs:
            left = self.pinned.pop(id(seq)) - 1
            if left:
                self.pinned[id(seq)] = left
        x, hops = self._recv(flight.tag)
        self._count_hops(batch.seqs, hops)
        hidden = engine.model.final_norm(x)
        scores, prompt_scores = engine.runner.pick_scores(hidden, flight.rows, flight.meta)
        live = [not s.freed for s in batch.seqs]
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            if i in prompt_scores and live[i]:
                add_prompt_logprobs(seq, prompt_scores[i], flight.starts[i], chunk)
        index = [i for i, r in enumerate(flight.rows) if r.samples]
        keep = [j for j, i in enumerate(index) if live[i] and not batch.seqs[i].finished]
        if not keep:
            return
        sampling = [batch.seqs[index[j]] for j in keep]
        choices = choose_later(scores[keep], sampling, engine.tokenizer.eos_token_id)
        for seq, choice in zip(sampling, choices.read()):
            engine._took(seq, seq.append(choice), out)

    def _recv(self, tag: str):
        """The micro-batch ``tag`` back from the last stage, however long the stages take while all of them live
        (one that dies ends this worker through ``Stages.on_lost``)."""
        while True:
            try:
                return self.link.recv(tag, 5.0)
            except TimeoutError:
                dead = [stage for stage, proc in self.stages.procs.items() if proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"pipeline stage {dead[0]} exited") from None

    def hand_out(self, engine, table: list[int], layers: list) -> list:
        """A prompt's KV of every layer, arrived here whole (a decode worker; from an mlx or tensor-parallel prefill,
        which do not send by layer): each other stage's layers go to it over its hop link, with a ``kv_relay`` on
        the plan ahead of any step that reads them; returns this stage's."""
        from kvtransfer.convert import layout_for

        layers = list(layers)
        for stage in range(1, len(self.stages.spans)):
            first, end = self.stages.spans[stage]
            part = [(k.contiguous(), v.contiguous()) for k, v in layers[first:end]]
            tag = f"kv{next(self.tags)}"
            self.stages.plan.send_to(stage, "kv_relay", table=list(table), tag=tag)
            layout = layout_for((end - first, *part[0][0].shape[1:]), part[0][0].shape[0], part[0][0].dtype)
            self.link.sender.send(self.stages.addresses[stage], tag, layout, part)
        return layers[self.span[0]:self.span[1]]

    def _count_hops(self, seqs, hops: list) -> None:
        add_hops(self.hop_totals, hops)
        for seq in seqs:
            seq.pp_hops = seq.pp_hops or []
            add_hops(seq.pp_hops, hops)

    def close(self) -> None:
        self.stages.close()
        if self.link is not None:
            self.link.close()


def add_hops(totals: list[dict], hops: list[dict]) -> None:
    """Add one micro-batch's hop phases to running sums per hop (``count``: the steps summed)."""
    while len(totals) < len(hops):
        totals.append({"count": 0})
    for total, hop in zip(totals, hops):
        total["count"] += 1
        for k, v in hop.items():
            total[k] = total.get(k, 0) + v
