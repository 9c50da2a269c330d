"""Every strict JSON answer keeps its contract: generated schemas (strings bounded and not, patterns, enums with
characters JSON must escape, integers and numbers with bounds, nested objects, arrays with item bounds), each
sampled at temperature 1 over many seeds on a random model, and every answer not cut by ``max_tokens`` parses and
validates with ``jsonschema``. Two vocabularies: the built-in tiny model's and a Hugging Face byte-fallback
tokenizer with ids that decode to nothing (as ``bench.random_checkpoint`` writes), where xgrammar's own bounded
strings once let raw control characters through (``engine.guided.grammars``)."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig
from engine.engine import Engine
from engine.requests import new_sequence
from engine.guided.grammars import json_schema_ebnf
from tests.checkpoints import write_checkpoint

SEEDS = 6
PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^\\d{3}-\\d{2}$", "^(yes|no)$", "^[^,]{0,4}$"]
TRICKY = ["a\nb", 'say "hi"', "tab\there", "back\\slash", "plain", "\u00e9t\u00e9"]

strings = st.one_of(
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 8)),
    st.builds(lambda hi: {"type": "string", "maxLength": hi}, st.integers(1, 10)),
    st.just({"type": "string"}),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(TRICKY), min_size=1, max_size=3, unique=True)),
)
numbers = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
              st.integers(-10, 10), st.integers(1, 20)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
)
leaves = st.one_of(strings, numbers)


def objects(children):
    return st.dictionaries(st.sampled_from(["a", "name", "k\"ey", "x_1", "n"]), children, min_size=1,
                           max_size=3).map(lambda props: {"type": "object", "properties": props,
                                                          "required": sorted(props), "additionalProperties": False})


def arrays(children):
    return st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
                     children, st.integers(0, 2), st.integers(0, 2))


schemas = st.recursive(leaves, lambda inner: st.one_of(objects(inner), arrays(inner)), max_leaves=5).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"],
                                                    "additionalProperties": False})


@pytest.fixture(scope="module", params=["builtin", "byte_fallback"])
def engine(request, tmp_path_factory):
    if request.param == "builtin":
        cfg = EngineConfig(device="cpu", dtype="float32", warmup=False)
    else:
        path = write_checkpoint(tmp_path_factory.mktemp("bf"), {"vocab_size": 512})
        os.remove(os.path.join(path, "generation_config.json"))  # as bench.random_checkpoint: no token suppressed
        cfg = EngineConfig(model=path, device="cpu", dtype="float32", warmup=False)
    return Engine(cfg)


def answers(engine, schema: dict) -> list[tuple[str, str]]:
    """``(text, finish)`` of each seed's answer, all of them batched in the engine's steps."""
    params = {"max_tokens": 120, "temperature": 1.0, "guide": {"kind": "json_schema", "value": schema}}
    seqs = [new_sequence(engine, f"s{seed}", {"prompt": "{", "params": {**params, "seed": seed}})
            for seed in range(SEEDS)]
    for seq in seqs:
        engine.add(seq)
    texts = {seq.rid: "" for seq in seqs}
    while engine.has_work:
        for tok in engine.step().tokens:
            texts[tok.seq.rid] += tok.text
    return [(texts[seq.rid], seq.finish_reason) for seq in seqs]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=schemas)
def test_every_strict_answer_parses_and_validates(engine, schema):
    stopped = 0
    for text, reason in answers(engine, schema):
        if reason == "length":
            continue  # cut by max_tokens: not a whole answer
        stopped += 1
        value = json.loads(text)  # raises on raw control characters and the like
        jsonschema.validate(value, schema)
    unbounded = '{"type": "string"}' in json.dumps(schema)  # a random model's string may run past max_tokens
    assert stopped >= 1 or unbounded, f"no answer ended: {schema}"


def test_the_engines_bounded_strings_admit_no_control_character():
    """The upstream bug this works around, as the grammar text shows it: a bounded string's characters exclude
    0x00-0x1f once pdserve has rewritten them (xgrammar 0.2.8 writes ``[^"\\\\\\r\\n]``)."""
    ebnf = json_schema_ebnf({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}})
    assert '[^\\0-\\x1f\\"\\\\]' in ebnf and '[^\\"\\\\\\r\\n]' not in ebnf
