"""Grammars a sequence's tokens must follow (``SamplingParams.guide``), with xgrammar.

A guide is ``{"kind": K, "value": V}``: ``json_object`` (any JSON object),
``json_schema`` (V a JSON schema), ``choice`` (V a list of strings: exactly
one of them), ``regex`` (V a regular expression) or ``grammar`` (V an EBNF
grammar with a ``root`` rule). JSON is compact: no whitespace beyond one
space after ``:`` and ``,``, so a bounded schema ends within a bounded number
of tokens even on a random model.

``Guides`` (one per engine) holds the tokenizer's vocabulary as xgrammar
reads it and compiles each guide once (kept, least recently used first, up to
``CACHE``). Each sequence gets a ``Guide``, a matcher over its compiled
grammar: before a token is chosen the sampler masks every token the grammar
does not allow (``mask_rows``: one bitmask for the batch's guided rows), and
the chosen token advances it (``accept``).
It ends the sequence once the grammar is complete (its stop token accepted).

Across the prefill -> decode handoff nothing else moves: the guide travels in
the sampling parameters, and the decode worker builds a matcher from it and
advances it over the tokens already chosen (``Guides.matcher(guide, tokens)``).
A guide that does not compile fails its request (400)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from ..errors import RequestError

CACHE = 256
KINDS = ("json_object", "json_schema", "choice", "regex", "grammar")


# xgrammar (0.2.8) writes a string with minLength/maxLength as a bounded repeat of this character class, which
# admits raw control characters (not JSON: a strict answer then fails to parse) while its unbounded strings exclude
# them. Bounded strings get the unbounded strings' class instead (escapes stay out of them, as xgrammar has it).
BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def json_schema_ebnf(schema: dict) -> str:
    """The compact-JSON grammar of ``schema`` as xgrammar writes it, with every string character one that JSON
    allows unescaped."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return ebnf.replace(BOUNDED_STRING_CHAR, JSON_STRING_CHAR)


def ebnf_choice(options: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


class Guide:
    """One sequence's matcher."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(int(token))

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


def mask_rows(scores: torch.Tensor, guided: list[tuple[int, "Guide"]]) -> None:
    """Set to -inf, in place, the score of every token the grammar of each guided row does not allow next: one
    bitmask filled on the host, one copy to the device, one masking call."""
    import xgrammar as xgr

    guided = [(row, guide) for row, guide in guided if not guide.done]  # ended: its token is dropped
    if not guided:
        return
    vocab = min(scores.shape[1], guided[0][1].vocab_size)
    bitmask = xgr.allocate_token_bitmask(scores.shape[0], guided[0][1].vocab_size)
    for row, guide in guided:
        guide.matcher.fill_next_token_bitmask(bitmask, row)
    rows = [row for row, _ in guided]
    xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True), vocab_size=vocab,
                                    indices=rows)
    if scores.shape[1] > vocab:
        scores[rows, vocab:] = float("-inf")


class Guides:
    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        hf = getattr(tokenizer, "tok", None)
        if hf is not None:
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        else:
            vocab = [tokenizer.token_bytes(i) for i in range(vocab_size)]
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                     stop_token_ids=[tokenizer.eos_token_id])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.compiled: OrderedDict[str, object] = OrderedDict()  # a compiled grammar, or the RequestError it gave
        self.lock = threading.Lock()  # the cache is shared with the compiling thread (``guided.background``)

    def has(self, guide: dict) -> bool:
        with self.lock:
            return json.dumps(guide, sort_keys=True) in self.compiled

    def compile(self, guide: dict, keep_errors: bool = False):
        """The compiled grammar (cached); a guide that does not compile raises ``RequestError``, which
        ``keep_errors`` caches too."""
        key = json.dumps(guide, sort_keys=True)
        with self.lock:
            if key in self.compiled:
                self.compiled.move_to_end(key)
                found = self.compiled[key]
                if isinstance(found, RequestError):
                    raise found
                return found
        try:
            grammar = self._compile(guide)
        except RequestError as e:
            if keep_errors:
                self._keep(key, e)
            raise
        self._keep(key, grammar)
        return grammar

    def _keep(self, key: str, value) -> None:
        with self.lock:
            self.compiled[key] = value
            while len(self.compiled) > CACHE:
                self.compiled.popitem(last=False)

    def _compile(self, guide: dict):
        kind, value = guide["kind"], guide.get("value")
        try:
            if kind == "json_object":
                grammar = self.compiler.compile_builtin_json_grammar()
            elif kind == "json_schema":
                grammar = self.compiler.compile_grammar(json_schema_ebnf(value))
            elif kind == "choice":
                grammar = self.compiler.compile_grammar(ebnf_choice(value))
            elif kind == "regex":
                grammar = self.compiler.compile_regex(value)
            else:
                grammar = self.compiler.compile_grammar(value)
        except Exception as e:  # xgrammar's own errors: the message says what is wrong with the input
            raise RequestError(f"the {kind} guide does not compile: {e}", param="response_format") from None
        return grammar

    def matcher(self, guide: dict, tokens=()) -> Guide:
        """A fresh matcher for ``guide``, advanced over ``tokens`` (those already chosen, e.g. by prefill)."""
        import xgrammar as xgr

        out = Guide(xgr.GrammarMatcher(self.compile(guide)), self.vocab_size)
        for t in tokens:
            if not out.accept(t):
                raise RequestError(f"token {t} does not follow the request's guide", param="response_format")
        return out


def engine_guides(engine) -> Guides:
    """The engine's ``Guides`` (built on first use, over the width of its logits: the model's vocabulary); a
    ``RequestError`` (501) where xgrammar does not import."""
    if getattr(engine, "_guides", None) is None:
        model = getattr(engine, "model", None)
        vocab = getattr(getattr(model, "spec", None), "vocab_size", None) \
            or getattr(getattr(model, "args", None), "vocab_size", None) or engine.tokenizer.vocab_size
        try:
            engine._guides = Guides(engine.tokenizer, vocab)
        except ImportError as e:  # xgrammar, or a library it needs, missing here: the request fails, not the worker
            raise RequestError(f"structured output is unavailable on this worker: {e}", status=501,
                               param="response_format") from None
    return engine._guides


def check_guide(guide) -> None:
    """Shape checks of a guide (its grammar is checked when it compiles)."""
    if guide is None:
        return
    if not isinstance(guide, dict) or guide.get("kind") not in KINDS:
        raise RequestError(f"guide must be a map with kind one of {KINDS}", param="response_format")
    kind, value = guide["kind"], guide.get("value")
    ok = {"json_object": value is None, "json_schema": isinstance(value, dict),
          "choice": isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value),
          "regex": isinstance(value, str) and bool(value), "grammar": isinstance(value, str) and bool(value)}[kind]
    if not ok or len(json.dumps(guide)) > 1 << 16:
        raise RequestError(f"bad {kind} guide (at most 64 KiB)", param="response_format")
