"""One step ahead: the next decode step is scheduled and launched while the
device still runs the one before, and the host reads that one's tokens
(and detokenizes, checks stops, emits) while the device runs the next.

A step that stays on the device (``keeps``: every row a one-token decode
through the captured graphs, no penalties, no prompt scores; under TP rank 0
broadcasts the chosen tokens on the device, ``parallel.plan``)
samples on the device into a tensor, copies it to pinned memory without
waiting (``sampler.Choices``) and holds a place in each sequence's
``output_ids`` (``Sequence.reserve``, the id ``PENDING``). The next step
(``can_follow``: nothing waiting, every running sequence a one-token decode
that needs no preemption) builds its rows with those places: a row whose
input is a held place names its row of the step in flight (``StepRow.feed``)
and the graph's input ids are filled from that step's device tokens
(``DecodeGraphs.run(feed=...)``), so no host round trip sits between the
two steps. Then the step in flight is read (``InFlight.finish``): each
token fills its place (``Sequence.fill``), which detokenizes, checks stops
and finishes the sequence; a sequence that finished there already has a row
in the step just launched: that row's token is dropped, and its blocks
return only after that step was queued (the device runs in order, so a
later step reusing them writes after it). A sequence that has reached its
length with a held place is not scheduled again (``Sequence.capped``). When
the next step cannot follow (a new request waits, a prompt chunk, a
penalty), the step in flight is read first and the engine steps as
before.

Guided sequences (structured outputs) step ahead too: their grammar masks
the next step's scores, so the step in flight is read right after the next
one is launched and before it is sampled: the host reads the token, advances
the matcher and fills the mask while the device runs the forward. A
sequence that the read finished holds no place in the new step."""
from __future__ import annotations

from dataclasses import dataclass

from .sampler import Choices


@dataclass
class InFlight:
    seqs: list  # the sampling sequences of the step, in row order
    places: list  # each one's index in its output_ids
    choices: Choices

    def rows_of(self) -> dict:
        return {id(seq): i for i, seq in enumerate(self.seqs)}

    def finish(self, accept) -> None:
        """Fill every held place with its token (``accept(seq, delta)`` for each live sequence)."""
        for seq, place, choice in zip(self.seqs, self.places, self.choices.read()):
            if not seq.freed and place is not None:
                accept(seq, seq.fill(place, choice))


def keeps(engine, rows, sampling) -> bool:
    """Whether the step just launched may stay on the device while the next one is prepared."""
    graphs = engine.runner.graphs
    return (engine.cfg.overlap and graphs is not None and not engine.hold_after_first
            and engine.on_schedule is None and len(sampling) == len(rows) and graphs.fits(len(rows))
            and all(engine.runner.decodes(r) for r in rows) and not any(s.params.penalized for s in sampling))


def can_follow(engine) -> bool:
    """Whether the next step can be scheduled and launched before the step in flight is read: it will be a pure
    decode of the running sequences (none waits, none preempted)."""
    s, blocks = engine.scheduler, engine.blocks
    if s.waiting:
        return False
    live = [q for q in s.running if not (q.pending and q.capped)]
    if not live or len(live) > s.max_batched_tokens or not engine.runner.graphs.fits(len(live)):
        return False
    grow = 0
    for q in live:
        if q.num_tokens - q.num_computed != 1 or q.params.penalized or q.params.prompt_logprobs is not None:
            return False
        grow += blocks.blocks_for(q.num_computed + 1) - len(q.block_table)
    return grow <= blocks.num_free
