"""Pipeline parallelism on the MLX engine: each rank of its ``mx.distributed`` group holds a range of the layers.

The ranks are the group ``--tp`` uses (``parallel.mlx_group``: a ring over
TCP, JACCL over Thunderbolt with ``PDSERVE_MLX_TP_BACKEND=jaccl``) and
replay rank 0's engine operations the same way (``MlxEngine.follow``), so
every forward runs on every rank with the same inputs. Each rank keeps its
layers of mlx-lm's model (``split.stage_spans``; the others are dropped)
and a cache per layer it holds. In a forward rank 0 embeds the tokens and
runs its layers, then sends the hidden states to rank 1
(``mx.distributed.send``); rank r receives them from r-1, runs its layers
and sends them on; the last rank applies the final norm and sends them back
to rank 0, which applies the LM head. A stage's output is evaluated before
its send, and the send evaluated alone: that time is the hop's ``wire``
phase (no copies: MLX sends its arrays' memory), and each follower reports
its hop (``{kind: hop, step, hop, wire, bytes}``); rank 0 collects every
hop of a forward when it lands, so each sequence's ``pp_hops`` has every
hop of every step it was in. A forward is ``launch`` (this stage's part)
then, on rank 0, ``land``: decode keeps one micro-batch in flight per stage
(``engine.mlx.batches``), so the stages work on different micro-batches at
once; a prompt's forward goes through alone.

KV leaves and enters through rank 0: ``gather`` collects every rank's
layers of a prompt (an all-gather of each rank's layers, padded to the
largest range), ``share`` hands each rank its layers of a KV that arrived."""
from __future__ import annotations

import queue
import time

from .driver import add_hops
from .split import stage_spans


class MlxStages:
    def __init__(self, model, group, spans_of: str | None, plan=None, report=None):
        """``group``: this rank's ``TPGroup`` (its ``group`` the mx group); ``plan``: rank 0's plan (where the
        hops are reported); ``report``: a follower's way to report them."""
        import mlx.core as mx

        self.mx, self.model, self.group = mx, model, group
        inner = model.model
        for name in ("embed_tokens", "layers", "norm"):
            if not hasattr(inner, name):
                raise ValueError(f"--pp on the mlx engine needs a model with embed_tokens, layers and norm "
                                 f"(mlx-lm's {type(model).__module__.rsplit('.', 1)[-1]} has no {name})")
        self.spans = stage_spans(len(inner.layers), group.size, spans_of)
        self.rank, self.size = group.rank, group.size
        self.span = self.spans[self.rank]
        inner.layers = inner.layers[self.span[0]:self.span[1]]  # the other layers' weights are freed
        self.norm = inner.norm
        if self.rank != self.size - 1:
            inner.norm = lambda h: h  # the last stage applies it
        mx.eval(model.parameters())
        self.hidden = self.norm.weight.shape[0]
        self.steps = 0
        self.hops: queue.Queue = queue.Queue()
        self.hop_totals: list[dict] = []  # per hop: phases summed over every step (bench)
        self.procs, self.report, self.last = getattr(group, "procs", {}), report, []
        self.first_hops: dict[int, dict] = {}  # rank 0: its own hop of each forward not landed yet
        self.early: dict[tuple, dict] = {}  # rank 0: (forward, rank) -> a hop reported before its forward landed
        if plan is not None:
            plan.by_kind["hop"] = self.hops.put

    def launch(self, ids, caches) -> int:
        """This stage's part of a forward: rank 0 embeds ``ids`` and runs its layers, the others take the hidden
        states from the stage before; the output goes to the next stage (the last one's back to rank 0, where
        ``land`` takes it). Returns the forward's tag (every rank counts the same forwards)."""
        mx, g = self.mx, self.group.group
        self.steps += 1
        inner = self.model.model
        if self.rank == 0:
            h = inner(ids, cache=caches)
        else:
            x = mx.distributed.recv((*ids.shape, self.hidden), self.norm.weight.dtype, self.rank - 1, group=g)
            h = inner(None, cache=caches, input_embeddings=x)
        mx.eval(h)
        began = time.perf_counter()
        mx.eval(mx.distributed.send(h, (self.rank + 1) % self.size, group=g))
        hop = {"wire": (time.perf_counter() - began) * 1e3, "bytes": h.nbytes}
        if self.rank != 0:
            self.report(kind="hop", step=self.steps, rank=self.rank, **hop)
        else:
            self.first_hops[self.steps] = hop
        return self.steps

    def land(self, tag: int, shape) -> object:
        """(Rank 0) The logits of forward ``tag`` (forwards land in the order launched); ``last`` its hops."""
        mx = self.mx
        out = mx.distributed.recv((*shape, self.hidden), self.norm.weight.dtype, self.size - 1, group=self.group.group)
        mx.eval(out)
        self.last = [self.first_hops.pop(tag)] + self._reports(tag)
        add_hops(self.hop_totals, self.last)
        head = getattr(self.model, "lm_head", None)
        return head(out) if head is not None else self.model.model.embed_tokens.as_linear(out)

    def _reports(self, step: int, timeout_s: float = 30.0) -> list[dict]:
        """The other stages' hops of forward ``step`` (each reported right after its send; those of later
        forwards kept for their turn)."""
        while sum(1 for key in self.early if key[0] == step) < self.size - 1:
            msg = self.hops.get(timeout=timeout_s)
            self.early[(msg["step"], msg["rank"])] = {"wire": msg["wire"], "bytes": msg["bytes"]}
        return [self.early.pop((step, r)) for r in range(1, self.size)]

    def gather(self, layers: list) -> list:
        """(Every rank) Every rank's ``(k, v)`` layers, in layer order, on every rank."""
        mx = self.mx
        most = max(end - first for first, end in self.spans)
        out = []
        for i in range(2):
            mine = mx.stack([kv[i] for kv in layers])
            pad = mx.zeros((most - mine.shape[0], *mine.shape[1:]), mine.dtype)
            every = mx.distributed.all_gather(mx.concatenate([mine, pad])[None], group=self.group.group)
            out.append([every[r, j] for r, (first, end) in enumerate(self.spans) for j in range(end - first)])
        return list(zip(*out))

    def share(self, full: list) -> list:
        """(Rank 0) Each rank's layers of a whole KV, by rank."""
        return [full[first:end] for first, end in self.spans]
