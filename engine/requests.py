"""Turning a control-plane request into a Sequence and its first token; shared
by the prefill worker and the colocated worker.

``first_message`` carries what the decode side needs to continue exactly as
one process would: the prompt's token ids and the fully resolved sampling
parameters (``max_tokens`` settled against the context limit)."""
from __future__ import annotations

import kvcache

from .emitted import Emitted
from .errors import RequestError
from .sampling import SamplingParams
from .sequence import Sequence, logprob_entry


def chat_prompt(tokenizer, messages, options: dict | None) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    options = options or {}
    add_generation_prompt = bool(options.get("add_generation_prompt", True))
    continue_final = bool(options.get("continue_final_message", False))
    if continue_final and add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
    if continue_final and messages[-1].get("role") != "assistant":
        raise RequestError("continue_final_message needs an assistant message last", param="continue_final_message")
    try:
        tools = options.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list", param="tools")
        if tools:
            return tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final, tools=tools)
        return tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final)
    except RequestError:
        raise
    except Exception as e:
        raise RequestError(f"the chat template could not render these messages: {e}", param="messages") from None


def new_sequence(engine, rid: str, msg: dict) -> Sequence:
    params = SamplingParams.from_dict(msg.get("params") or {})
    if msg.get("messages") is not None:
        prompt = chat_prompt(engine.tokenizer, msg["messages"], msg.get("chat"))
    else:
        prompt = msg.get("prompt")
        if not isinstance(prompt, (str, list)):
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
    return guided(engine, Sequence.create(rid, prompt, params, engine.tokenizer, engine.max_len))


def resumed_sequence(engine, rid: str, prompt_ids, first_token, emitted, params, earlier=()) -> Sequence:
    """A sequence that goes on from a first token chosen elsewhere, as ``first_message`` described it (decode after
    prefill, or a colocated worker taking over a request whose first token its client already has); or, with the
    output tokens ``earlier`` than it, from the last token of a sequence moved from another decode worker."""
    try:
        resolved = SamplingParams.from_dict(params, resolved=True)
        seq = Sequence.resume(rid, prompt_ids, first_token, emitted, resolved, engine.tokenizer, engine.max_len,
                              earlier or ())
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(f"bad continuation of a first token: {e}") from None
    return guided(engine, seq)


def guided(engine, seq: Sequence) -> Sequence:
    """``seq`` with the matcher of its guide, if it has one, advanced over the tokens it already has."""
    if seq.params.guide is None:
        return seq
    seq.guide = engine.guides.matcher(seq.params.guide, seq.output_ids)
    return seq


def first_message(tok: Emitted, prefill_ms: float, queue_ms: float) -> dict:
    """``first`` for a sequence's first token (``tok``: what the step emitted for it, ``engine.emitted``)."""
    seq = tok.seq
    out = {
        "token": tok.token,
        "text": tok.text,
        "emitted": tok.emitted,
        "prompt_tokens": len(seq.prompt_ids),
        "prompt_ids": seq.prompt_ids,
        "params": seq.params.to_dict(),
        "finish_reason": tok.finish_reason,
        "logprobs": tok.logprobs,
        "timing": {"queue": queue_ms, "prefill": prefill_ms},
    }
    out["timing"].update(pp_timing(seq), **kvcache.phases(seq))
    if seq.params.echo:
        out["prompt_text"] = seq.tokenizer.decode(seq.prompt_ids)
        plp = seq.prompt_logprob_list
        if plp is not None:
            out["prompt_logprobs"] = [
                logprob_entry(seq.tokenizer, t, e[0], e[1]) if e else logprob_entry(seq.tokenizer, t, None, [])
                for t, e in zip(seq.prompt_ids, plp)]
    return out


def pp_timing(seq: Sequence) -> dict:
    """The phases of the pipeline hops that carried ``seq`` (``engine.pipeline``; nothing without one)."""
    return {"pp_hops": seq.pp_hops} if seq.pp_hops else {}
