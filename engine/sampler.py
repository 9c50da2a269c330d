"""Batched token choice on the logits' device.

Each row is one sequence with its own parameters. Penalties and filters
(repetition, frequency, presence, min_tokens, top-k, top-p, min-p) shape the
scores; greedy rows take the argmax, the others the argmax of scores plus
Gumbel noise, which samples from ``softmax(scores / temperature)``. The noise
comes from a counter-based hash of ``(seed, step, token id)``: no generator
state, the same draw on every process and batch position, so a request gives
the same tokens whether its prefill and decode run in one process or two and
whoever it is batched with. Logprobs are the model's own (log-softmax of the
raw scores, before penalties and temperature)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass
class TokenChoice:
    token: int
    logprob: float | None = None
    top: list | None = None


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: list[int], steps: list[int], vocab: int, device) -> torch.Tensor:
    """``[rows, vocab]`` uniforms in (0, 1), a pure function of (seed, step, token id)."""
    seed = torch.tensor(seeds, dtype=torch.int64, device=device)
    step = torch.tensor(steps, dtype=torch.int64, device=device)
    key = _mix(_mix((seed & MASK32) ^ _mix(((seed >> 32) & MASK32) + 0x9E3779B9)) ^ (step & MASK32))
    token = _mix(torch.arange(vocab, dtype=torch.int64, device=device) + 0x632BE5AB)
    bits = _mix(key[:, None] ^ token[None, :]) >> 8
    return (bits.to(torch.float32) + 0.5) / float(1 << 24)


def _penalize(scores: torch.Tensor, row: int, params, prompt_ids, output_ids) -> None:
    device, vocab = scores.device, scores.shape[1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long, device=device)] = True
        s = scores[row]
        s[seen] = torch.where(s[seen] > 0, s[seen] / params.repetition_penalty, s[seen] * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab)[:vocab]
        scores[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filter(scores: torch.Tensor, params) -> torch.Tensor:
    """Top-k, top-p and min-p on one row of temperature-scaled scores (kept tokens unchanged, others -inf)."""
    if params.top_k > 0 and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        if params.min_p > 0.0:
            scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
    return scores


def choose(logits: torch.Tensor, seqs, eos_token_id: int | None = None) -> list[TokenChoice]:
    """One token for each row of ``logits`` ``[rows, vocab]``; ``seqs[i]`` has ``params``, ``prompt_ids``,
    ``output_ids``."""
    return choose_later(logits, seqs, eos_token_id).read()


class Choices:
    """Tokens (and logprobs) chosen on the device, copied to pinned host memory without waiting; ``read`` waits
    for the copy (an event) and gives the ``TokenChoice`` of each row."""

    def __init__(self, tokens: torch.Tensor, logprobs: tuple | None, wanted: list[int], counts: list[int]):
        self.wanted, self.counts = wanted, counts
        self.device_tokens = tokens
        self._host = [_to_host(tokens)] + ([_to_host(t) for t in logprobs] if logprobs else [])
        self._event = torch.cuda.Event() if tokens.device.type == "cuda" else None
        if self._event is not None:
            self._event.record()

    def read(self) -> list[TokenChoice]:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[0].tolist()
        choices = [TokenChoice(t) for t in tokens]
        if self.wanted:
            chosen, top_lp, top_id = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self.wanted):
                n = self.counts[j]
                choices[i].logprob = chosen[j]
                choices[i].top = list(zip(top_id[j][:n], top_lp[j][:n])) if n else []
        return choices


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def choose_later(logits: torch.Tensor, seqs, eos_token_id: int | None = None) -> Choices:
    """``choose`` without waiting for the device: penalties read each sequence's ``output_ids`` (so they must be
    known), everything else runs on the device."""
    logits = logits.float()
    scores = logits.clone()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.penalized:
            _penalize(scores, i, p, seq.prompt_ids, seq.output_ids)
        if len(seq.output_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])
            banned = [t for t in banned if 0 <= t < scores.shape[1]]
            if banned:
                scores[i, banned] = float("-inf")
    guided = [(i, seq.guide) for i, seq in enumerate(seqs) if getattr(seq, "guide", None) is not None]
    if guided:
        from .guided.grammars import mask_rows

        mask_rows(scores, guided)
    tokens = scores.argmax(dim=-1)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        noise = uniform_noise([seqs[i].params.seed for i in sampled], [len(seqs[i].output_ids) for i in sampled],
                              scores.shape[1], scores.device)
        for j, i in enumerate(sampled):
            row = _filter(scores[i] / seqs[i].params.temperature, seqs[i].params)
            tokens[i] = torch.argmax(row - torch.log(-torch.log(noise[j])))
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs = None
    if wanted:
        index = torch.tensor(wanted, device=logits.device)
        logp = torch.log_softmax(logits[index], dim=-1)
        k = max(seqs[i].params.logprobs for i in wanted)
        chosen = logp.gather(1, tokens[index][:, None])[:, 0]
        top_lp, top_id = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        logprobs = (chosen, top_lp, top_id)
    return Choices(tokens, logprobs, wanted, [seqs[i].params.logprobs for i in wanted])
