"""The MLX engine's running sequences, in as many micro-batches as pipeline stages (one without a pipeline).

A sequence joins the micro-batch with the fewest sequences and stays there;
each micro-batch has its own batched caches (mlx-lm's ``BatchKVCache``, one
per layer). A decode step launches the next idle micro-batch that has
sequences and, once nothing more can be launched, lands the oldest in
flight: its logits are sampled and every rank appends the tokens. Without a
pipeline a launch is the lazy forward and the landing follows at once. In a
pipeline (``mlx_stages``) rank 0 launches by running its layers and sending
the hidden states on, every other stage does its part as soon as they
arrive, and the landing takes the last stage's output back: so stage 1 works
on one micro-batch while stage 0 works on the next, and with as many
micro-batches as stages every stage works every step.

The ring carries one conversation at a time and every stage's caches must be
in step, so anything else that uses them (a prompt's forward, KV gathered
or shared, a sequence joining or leaving a micro-batch in flight) first
lands every micro-batch in flight (``drain``); tokens landed outside a step
are handed out by the next one. Every rank runs this code on the same
mirrored state, so all launch and land alike."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class MicroBatch:
    seqs: list = field(default_factory=list)
    caches: list | None = None  # per layer, this rank's
    tag: int | None = None  # in flight: the forward's tag
    logits: object = None  # without a pipeline: the lazy forward


class MlxBatches:
    def __init__(self, engine, count: int):
        self.engine = engine
        self.batches = [MicroBatch() for _ in range(max(1, count))]
        self.flights: deque[MicroBatch] = deque()
        self.landed: list = []  # (seq, appended) landed by a drain outside a step
        self.turn = 0
        self.tags = 0
        self.most_in_flight = 0

    @property
    def running(self) -> list:
        return [s for b in self.batches for s in b.seqs]

    def join(self, seq, caches: list) -> None:
        batch = min(self.batches, key=lambda b: len(b.seqs))
        if batch.tag is not None:
            self.drain()
        new = [self.engine._batch_cache.merge([c]) for c in caches]
        if batch.caches is None:
            batch.caches = new
        else:
            for mine, more in zip(batch.caches, new):
                mine.extend(more)
        batch.seqs.append(seq)

    def drop(self, seq) -> bool:
        """Take ``seq`` out of its micro-batch (landing what is in flight if it is); False if it is in none."""
        batch = next((b for b in self.batches if seq in b.seqs), None)
        if batch is None:
            return False
        if batch.tag is not None:
            self.drain()
            self.landed = [(s, t) for s, t in self.landed if s is not seq]
            if seq not in batch.seqs:  # finished as it landed
                return True
        keep = [i for i, s in enumerate(batch.seqs) if s is not seq]
        batch.seqs = [batch.seqs[i] for i in keep]
        if keep:
            index = self.engine.mx.array(keep)
            for cache in batch.caches:
                cache.filter(index)
        else:
            batch.caches = None
        return True

    def step(self, out) -> None:
        """One decode step: launch the next idle micro-batch; land the oldest once nothing more can be launched."""
        out.tokens.extend(self.landed)
        self.landed = []
        nxt = self._next_idle()
        if nxt is not None:
            self._launch(nxt)
        if self.flights and self._next_idle() is None:
            self._land(out)

    def drain(self, out=None) -> None:
        """Land every micro-batch in flight (their tokens into ``out``, or kept for the next step)."""
        while self.flights:
            if out is None:
                from .engine import StepOutput

                held = StepOutput()
                self._land(held)
                self.landed.extend(held.tokens)
            else:
                self._land(out)

    def _next_idle(self) -> MicroBatch | None:
        n = len(self.batches)
        for i in range(n):
            batch = self.batches[(self.turn + i) % n]
            if batch.seqs and batch.tag is None:
                self.turn = (self.turn + i + 1) % n
                return batch
        return None

    def _launch(self, batch: MicroBatch) -> None:
        engine = self.engine
        ids = engine.mx.array([[s.output_ids[-1]] for s in batch.seqs])
        if engine.pipeline is None:
            self.tags += 1
            batch.tag, batch.logits = self.tags, engine.model(ids, cache=batch.caches)
        else:
            batch.tag = engine.pipeline.launch(ids, batch.caches)
        for s in batch.seqs:
            s.num_computed += 1
        self.flights.append(batch)
        self.most_in_flight = max(self.most_in_flight, len(self.flights))

    def _land(self, out) -> None:
        engine, batch = self.engine, self.flights.popleft()
        seqs = list(batch.seqs)
        logits = batch.logits
        if engine.pipeline is not None:
            if engine.plan_in is None:
                logits = engine.pipeline.land(batch.tag, (len(seqs), 1))
                engine.add_step_hops(seqs)
            else:
                logits = engine.mx.array(0.0)  # a follower: rank 0 samples
        batch.tag, batch.logits = None, None
        choices = engine._pick(logits[:, -1, :] if logits.ndim == 3 else logits, seqs)
        out.batch_tokens += len(seqs)
        for seq, choice in zip(seqs, choices):
            out.tokens.append((seq, seq.append(choice)))
        engine._chosen(seqs)
        for seq in seqs:
            if engine._finished(seq):
                engine._drop(seq)
