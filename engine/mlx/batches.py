"""The MLX engine's forwards: running sequences in as many micro-batches as pipeline stages (one without a
pipeline), and prompt chunks.

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

A prompt's chunks are flights too: each writes its own caches, layer by
layer in stage order, so the next chunk can follow it into stage 0 at once
(a long prompt fills the pipeline alone); its last chunk's landing gives the
first token. Decode micro-batches and prompt chunks take turns at the last
free place. Flights land in the order launched, which is the order of the
messages on every link of the ring. Anything else that uses the ring or the
caches (KV gathered for a prefill worker, a sequence joining or leaving a
micro-batch in flight) first lands everything in flight (``drain``); tokens
landed outside a step are handed out by the next one. Every rank runs this
code on the same mirrored state, so all launch and land alike."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..emitted import Emitted


@dataclass
class Chunk:
    """A prompt chunk's forward (``MlxEngine.launch_chunk``)."""
    seq: object
    caches: list
    tokens: int
    last: bool  # its logits give the prompt's first token
    tag: int | None = None
    logits: object = None


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
        self.flights: deque[MicroBatch | Chunk] = deque()
        self.landed: list = []  # (seq, appended) landed by a drain outside a step
        self.depth = max(1, count)  # forwards in flight at most: one per stage
        self.turn = 0
        self.chunk_first = False
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
        if self._in_flight(seq):
            self.drain()  # what it is in lands first (its prompt may finish and join a micro-batch)
            self.landed = [(s, t) for s, t in self.landed if s is not seq]
        batch = next((b for b in self.batches if seq in b.seqs), None)
        if batch is None:
            return False
        self._remove(batch, seq)
        return True

    def take_out(self, seq) -> list | None:
        """``seq`` out of its micro-batch with its KV: a cache a layer holding its rows alone (None if it is in
        none). What it is in flight with lands first; a token so landed goes out with the next step."""
        if self._in_flight(seq):
            self.drain()
        batch = next((b for b in self.batches if seq in b.seqs), None)
        if batch is None:
            return None
        index = batch.seqs.index(seq)
        caches = [cache.extract(index) for cache in batch.caches]
        self._remove(batch, seq)
        return caches

    def holds_token(self, seq) -> bool:
        """A token of ``seq`` landed outside a step and not yet handed out."""
        return any(s is seq for s, _ in self.landed)

    def _in_flight(self, seq) -> bool:
        return any(f.seq is seq if isinstance(f, Chunk) else seq in f.seqs for f in self.flights)

    def _remove(self, batch: MicroBatch, seq) -> None:
        keep = [i for i, s in enumerate(batch.seqs) if s is not seq]
        batch.seqs = [batch.seqs[i] for i in keep]
        if keep:
            index = self.engine.mx.array(keep)
            for cache in batch.caches:
                cache.filter(index)
        else:
            batch.caches = None

    def step(self, out) -> None:
        """Without a pipeline: a decode forward of the micro-batch, then a prompt chunk's. In one: launch the next
        idle micro-batch and the next prompt chunk (taking turns at the last free place) while fewer than ``depth``
        are in flight, then land the oldest while ``depth`` are, or all once nothing more can be launched."""
        out.tokens.extend(self.landed)
        self.landed = []
        engine = self.engine
        if engine.pipeline is None:
            if self.batches[0].seqs:
                self._launch(self.batches[0])
                self._land(out)
            chunk = engine.launch_chunk(out)
            if chunk is not None:
                self.flights.append(chunk)
                self._land(out)
            return
        self.chunk_first = not self.chunk_first
        for kind in ("chunk", "decode") if self.chunk_first else ("decode", "chunk"):
            if len(self.flights) >= self.depth:
                break
            if kind == "decode" and (batch := self._next_idle()) is not None:
                self._launch(batch)
            elif kind == "chunk" and (chunk := engine.launch_chunk(out)) is not None:
                self.flights.append(chunk)
        self.most_in_flight = max(self.most_in_flight, len(self.flights))
        while self.flights and (len(self.flights) >= self.depth or not self._can_launch()):
            self._land(out)

    def _can_launch(self) -> bool:
        waiting = self.engine.waiting
        return any(b.seqs and b.tag is None for b in self.batches) or \
            any(s.num_computed < s.num_tokens for s in waiting)

    def drain(self, out=None) -> None:
        """Land every micro-batch in flight (their tokens into ``out``, or kept for the next step)."""
        from ..step_output import StepOutput

        into = out if out is not None else StepOutput()
        while self.flights:
            self._land(into)
        if out is None:
            self.landed.extend(into.tokens)

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
        if engine.pipeline is None:  # (tag 0: in flight, lands in this step)
            batch.tag, batch.logits = 0, engine.model(ids, cache=batch.caches)
        else:
            batch.tag = engine.pipeline.launch(ids, batch.caches)
        for s in batch.seqs:
            s.num_computed += 1
        self.flights.append(batch)

    def _land(self, out) -> None:
        engine, flight = self.engine, self.flights.popleft()
        chunk = isinstance(flight, Chunk)
        seqs = [flight.seq] if chunk else list(flight.seqs)
        logits = flight.logits
        if engine.pipeline is not None:
            if engine.plan_in is None:
                logits = engine.pipeline.land(flight.tag, (1, flight.tokens) if chunk else (len(seqs), 1))
                engine.add_step_hops(seqs)
            else:
                logits = engine.mx.array(0.0)  # a follower: rank 0 samples
        flight.tag, flight.logits = None, None
        logits = logits[:, -1, :] if logits.ndim == 3 else logits  # each row's last position
        if chunk:
            engine.land_chunk(flight, logits, out)
            return
        choices = engine._pick(logits, seqs)
        out.batch_tokens += len(seqs)
        for seq, choice in zip(seqs, choices):
            out.tokens.append(Emitted.of(seq, seq.append(choice)))
        engine._chosen(seqs)
        for seq in seqs:
            if engine._finished(seq):
                engine._drop(seq)
