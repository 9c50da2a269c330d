"""Structured outputs: JSON schemas, choices and regexes enforced on the tiny random model, the same tokens
disaggregated and colocated (the guide crosses the prefill -> decode handoff), and what cannot be honoured
refused with a 400 while the server keeps serving."""
from __future__ import annotations

import contextlib
import json
import threading
import time
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import EngineConfig
from engine.engine import Engine
from engine.errors import RequestError
from engine.requests import new_sequence, resumed_sequence

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "size", "flags", "inner"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": -5, "maximum": 500},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "inner": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                   "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}}}}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(device="cpu", dtype="float32", warmup=False))


def run(engine, seqs) -> list[str]:
    for s in seqs:
        engine.add(s)
    texts = {s.rid: "" for s in seqs}
    while engine.has_work:
        for s, delta in ((tok.seq, tok.text) for tok in engine.step().tokens):
            texts[s.rid] += delta
    return [texts[s.rid] for s in seqs]


def test_twenty_seeds_of_a_nested_schema_all_parse_and_validate(engine):
    params = {"max_tokens": 200, "temperature": 1.0, "guide": {"kind": "json_schema", "value": SCHEMA}}
    seqs = [new_sequence(engine, f"s{seed}", {"prompt": "JSON please:", "params": {**params, "seed": seed}})
            for seed in range(20)]
    outs = run(engine, seqs)
    for seq, text in zip(seqs, outs):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert seq.finish_reason == "stop"
    assert len(set(outs)) > 5  # sampled, not one fixed answer


def test_choices_and_regexes_hold_on_the_random_model(engine):
    choice = {"kind": "choice", "value": ["yes", "no", "maybe later"]}
    regex = {"kind": "regex", "value": r"[A-Z]{2}-\d{3}"}
    seqs = [new_sequence(engine, f"c{i}", {"prompt": "Pick:", "params": {"max_tokens": 32, "temperature": 1.0,
                                                                         "seed": i, "guide": guide}})
            for i, guide in enumerate([choice] * 6 + [regex] * 6)]
    outs = run(engine, seqs)
    assert all(o in choice["value"] for o in outs[:6])
    assert all(re.fullmatch(regex["value"], o) for o in outs[6:]), outs[6:]


def test_an_ebnf_grammar_holds(engine):
    grammar = {"kind": "grammar", "value": 'root ::= "(" item (", " item)* ")"\nitem ::= [a-c] [0-9]'}
    seqs = [new_sequence(engine, f"e{i}", {"prompt": "List:", "params": {"max_tokens": 40, "temperature": 1.0,
                                                                         "seed": i, "guide": grammar}})
            for i in range(6)]
    outs = run(engine, seqs)
    for seq, text in zip(seqs, outs):
        assert seq.finish_reason == "length" or re.fullmatch(r"\([a-c][0-9](, [a-c][0-9])*\)", text), text
    assert sum(seq.finish_reason == "stop" for seq in seqs) >= 3  # most lists close within 40 tokens


def test_a_resumed_sequence_rebuilds_its_matcher_over_the_tokens_it_has(engine):
    guide = {"kind": "json_schema", "value": SCHEMA}
    whole = new_sequence(engine, "w", {"prompt": "x", "params": {"max_tokens": 200, "temperature": 0, "guide": guide}})
    (text,) = run(engine, [whole])
    resumed = resumed_sequence(engine, "r", whole.prompt_ids, whole.output_ids[0], 0, whole.params.to_dict())
    assert run(engine, [resumed])[0] == text  # emitted=0: its text from the first token on
    with pytest.raises(RequestError, match="does not follow"):
        resumed_sequence(engine, "bad", whole.prompt_ids, engine.tokenizer.encode("}", add_bos=False)[0], 0,
                         whole.params.to_dict())


def test_guides_hold_in_a_tensor_parallel_group_and_batched_with_free_rows():
    from engine.factory import make_engine

    tp = make_engine(EngineConfig(device="cpu", dtype="float32", warmup=False, tp=2))
    try:
        guide = {"kind": "json_schema", "value": SCHEMA}
        seqs = [new_sequence(tp, f"t{i}", {"prompt": "JSON:", "params": {
            "max_tokens": 200, "temperature": 1.0, "seed": i, **({"guide": guide} if i % 2 else {})}})
            for i in range(6)]
        outs = run(tp, seqs)
        for i, text in enumerate(outs):
            if i % 2:
                jsonschema.validate(json.loads(text), SCHEMA)
        assert not any(is_json(t) for t in outs[::2])  # the rows without a guide stay free text
    finally:
        tp.close()


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_guided_rows_step_ahead_with_the_same_tokens():
    """One step ahead (decode graphs run eagerly on the CPU): the step in flight is read before the next is
    sampled; the tokens equal reading every step at once."""
    guide = {"kind": "json_schema", "value": SCHEMA}
    outs = []
    for ahead in (True, False):
        eng = Engine(EngineConfig(device="cpu", dtype="float32", warmup=False, decode_graphs="eager", overlap=ahead))
        seqs = [new_sequence(eng, f"o{i}", {"prompt": f"JSON {i}:", "params": {
            "max_tokens": 120, "temperature": 1.0, "seed": i, **({"guide": guide} if i % 3 else {})}})
            for i in range(9)]
        outs.append(run(eng, seqs))
        assert (eng.overlapped > 0) == ahead
    assert outs[0] == outs[1]
    for i, text in enumerate(outs[0]):
        if i % 3:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_a_guide_that_does_not_compile_is_a_400(engine):
    with pytest.raises(RequestError, match="does not compile") as e:
        new_sequence(engine, "g", {"prompt": "x", "params": {"max_tokens": 4, "guide": {"kind": "regex",
                                                                                        "value": "(unclosed"}}})
    assert e.value.status == 400


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


def chat(url, max_tokens: int = 120, **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "A pet?"}],
                                          temperature=0, max_tokens=max_tokens, **kw)


def test_disaggregated_and_colocated_give_the_same_valid_json(disagg, colocated):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    outs = [chat(c.url, response_format=fmt).choices[0].message.content for c in (disagg, colocated)]
    assert outs[0] == outs[1]
    jsonschema.validate(json.loads(outs[0]), SCHEMA)
    client = openai.OpenAI(base_url=disagg.url + "/v1", api_key="none")
    parsed = client.chat.completions.parse(model="tiny-llama", messages=[{"role": "user", "content": "A pet?"}],
                                           response_format=Pet, max_tokens=120, seed=3)
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    text = httpx.post(disagg.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Answer:",
                      "max_tokens": 16, "guided_choice": ["left", "right"], "stream": True}).text
    pieces = [json.loads(line[6:])["choices"] for line in text.splitlines()
              if line.startswith("data: {") and '"choices"' in line]
    assert "".join(c[0].get("text") or "" for c in pieces if c) in ("left", "right")


@pytest.mark.parametrize("endpoint,field,value", [
    ("completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "required"), ("chat/completions", "logit_bias", {"5": 10}),
    ("chat/completions", "functions", [{"name": "f"}]), ("chat/completions", "response_format", {"type": "xml"}),
    ("chat/completions", "guided_regex", "(unclosed")])
def test_what_cannot_be_honoured_is_a_400_and_the_server_keeps_serving(disagg, endpoint, field, value):
    body = {"model": "tiny-llama", "max_tokens": 4, field: value,
            **({"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    r = httpx.post(f"{disagg.url}/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field.split("_")[0] in message or "compile" in message, message
    assert chat(disagg.url, max_tokens=4).choices[0].message.content is not None


def test_a_grammar_compiles_off_the_engine_thread_and_a_plain_request_does_not_wait(monkeypatch):
    """A worker's first guided request builds the vocabulary's grammar state and compiles (made to take 1.5 s
    here): the engine thread hands that to a thread of its own and keeps serving; a plain request sent just after
    is answered first, the guided one then follows its grammar, and one that does not compile is still a 400."""
    from decode.worker import DecodeWorker
    from engine.guided import grammars

    slow = grammars.Guides._compile

    def slower(self, guide):
        time.sleep(1.5)
        return slow(self, guide)
    monkeypatch.setattr(grammars.Guides, "_compile", slower)
    w = DecodeWorker(EngineConfig(device="cpu", dtype="float32", warmup=False), colocated=True)
    got, ended = {}, {}
    w.emit = lambda rid, op, **f: (got.setdefault(rid, []).append((op, f)),
                                   ended.setdefault(rid, time.monotonic()) if op in ("done", "error") else None)
    with looping(w) as loop:
        for rid in ("guided", "bad", "plain"):
            w.reply_to[rid] = b"router"
        guide = {"kind": "regex", "value": "(ab){2,3}c"}
        w.inbox.put({"op": "generate", "rid": "guided", "prompt": "x", "params": {"max_tokens": 12, "guide": guide}})
        w.inbox.put({"op": "generate", "rid": "bad", "prompt": "x",
                     "params": {"max_tokens": 4, "guide": {"kind": "regex", "value": "(unclosed"}}})
        w.inbox.put({"op": "generate", "rid": "plain", "prompt": "x", "params": {"max_tokens": 4}})
        t0 = time.monotonic()
        loop.start()
        deadline = time.monotonic() + 30
        while len(ended) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ended["plain"] - t0 < 1.2 and ended["guided"] - t0 >= 1.5, {k: v - t0 for k, v in ended.items()}
        text = got["guided"][0][1]["text"] + "".join(f["text"] for op, f in got["guided"][1:])
        assert re.fullmatch("(ab){2,3}c", text), text
        assert got["bad"][-1][0] == "error" and got["bad"][-1][1]["status"] == 400
        assert not w.live and w.engine.blocks.num_free == w.engine.num_blocks


@contextlib.contextmanager
def looping(w):
    """The worker loop (its inbox, then a step) on a thread the block starts; stopped, and the worker closed, after."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            _drain(w)
            w.tick()
            time.sleep(0.001)
    loop = threading.Thread(target=serve)
    try:
        yield loop
    finally:
        stop.set()
        if loop.is_alive():
            loop.join(10)
        w.close()


def _drain(w):
    """One pass of the worker loop's inbox (what ``serve_forever`` does between steps)."""
    import queue

    try:
        while True:
            w._safe_handle(w.inbox.get_nowait())
    except queue.Empty:
        pass


def test_where_xgrammar_does_not_import_a_guided_request_is_a_501_and_a_plain_one_is_served(monkeypatch):
    """xgrammar, or a library it needs, missing on a worker: each guided request gets a 501 at once (it once went
    back to the compiling thread forever, and the router's stall watchdog ended it 90 s later), and the worker
    serves plain requests."""
    import builtins

    from decode.worker import DecodeWorker

    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar" or name.startswith("xgrammar."):
            raise ImportError("No module named 'tvm_ffi'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    w = DecodeWorker(EngineConfig(device="cpu", dtype="float32", warmup=False), colocated=True)
    got = {}
    w.emit = lambda rid, op, **f: got.setdefault(rid, []).append((op, f))
    with looping(w) as loop:
        guide = {"kind": "json_schema", "value": SCHEMA}
        for rid in ("guided-1", "guided-2", "plain"):
            w.reply_to[rid] = b"router"
            params = {"max_tokens": 4, **({"guide": guide} if rid != "plain" else {})}
            w.inbox.put({"op": "generate", "rid": rid, "prompt": "x", "params": params})
        loop.start()
        deadline = time.monotonic() + 30
        while not all(got.get(r) and got[r][-1][0] in ("done", "error") for r in ("guided-1", "guided-2", "plain")) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        for rid in ("guided-1", "guided-2"):
            op, fields = got[rid][-1]
            assert op == "error" and fields["status"] == 501 and "tvm_ffi" in fields["message"], got[rid]
        assert got["plain"][-1][0] == "done"
        assert not w.live and w.engine.blocks.num_free == w.engine.num_blocks
