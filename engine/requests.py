"""Turning a control-plane request into a Sequence and its first token; shared
by the prefill worker and the colocated worker."""
from __future__ import annotations

import time

from .errors import RequestError
from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence


def new_sequence(runner: ModelRunner, rid: str, msg: dict) -> Sequence:
    params = SamplingParams.from_dict(msg.get("params") or {})
    messages = msg.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        prompt = runner.tokenizer.apply_chat_template(messages)
    else:
        prompt = msg.get("prompt")
        if not isinstance(prompt, (str, list)):
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
    return Sequence.create(rid, prompt, params, runner.tokenizer, runner.max_len)


def run_prefill(runner: ModelRunner, seq: Sequence, into: list | None = None):
    """Forward the prompt (KV into ``into`` when given), sample the first token; returns ``(text, kv, ms)``."""
    start = time.perf_counter()
    logits, kv = runner.prefill(seq.prompt_ids, into)
    text = seq.accept(logits)
    return text, kv, (time.perf_counter() - start) * 1e3


def first_message(seq: Sequence, text: str, prefill_ms: float, queue_ms: float) -> dict:
    return {
        "token": seq.output_ids[-1],
        "text": text,
        "emitted": seq.detok.emitted,
        "prompt_tokens": len(seq.prompt_ids),
        "finish_reason": seq.finish_reason,
        "timing": {"queue": queue_ms, "prefill": prefill_ms},
    }
