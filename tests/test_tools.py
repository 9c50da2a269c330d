"""Tool calling: forced choices enforced by a grammar on the tiny random model, the calls parsed per model
family, streamed as OpenAI streams them, through the openai SDK and LangChain."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from router.tools.parse import parse_auto, parse_forced
from router.tools.spec import check_tools, choice_mode, forced_guide

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
NAMES = {"get_weather", "get_time"}


def test_calls_are_read_as_each_family_writes_them():
    hermes = 'Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = parse_auto(hermes, NAMES)
    assert content == "Sure." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    _, calls = parse_auto('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]', NAMES)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    _, calls = parse_auto('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', NAMES)
    assert calls[0]["function"]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    assert parse_auto('{"name": "rm_rf", "arguments": {}}', NAMES) == ('{"name": "rm_rf", "arguments": {}}', [])
    assert parse_auto("just words", NAMES) == ("just words", [])
    two = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    assert len(parse_forced(two, NAMES)) == 2 and parse_forced("not json", NAMES) == []


def test_tool_choices_are_checked():
    functions = check_tools(TOOLS)
    assert choice_mode(None, functions) == ("auto", None) and choice_mode(None, None) == ("none", None)
    assert choice_mode({"type": "function", "function": {"name": "get_time"}}, functions) == ("forced", "get_time")
    for bad, message in (("required", "needs tools"), ({"type": "function", "function": {"name": "nope"}}, "not among"),
                         ("sometimes", "tool_choice must be")):
        with pytest.raises(ValueError, match=message):
            choice_mode(bad, None if bad == "required" else functions)
    with pytest.raises(ValueError, match="twice"):
        check_tools(TOOLS + TOOLS[:1])
    schema = forced_guide(functions, None, parallel=False)["value"]
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def ask(url, **kw):
    return client(url).chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Weather?"}],
                                               tools=TOOLS, max_tokens=160, **kw)


def arguments_valid(call) -> bool:
    schema = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return True


def test_required_and_named_choices_give_valid_calls_disaggregated(disagg):
    for seed in range(4):
        out = ask(disagg.url, tool_choice="required", seed=seed, temperature=1.0, parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert arguments_valid(choice.message.tool_calls[0])
    named = ask(disagg.url, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0)
    assert {c.function.name for c in named.choices[0].message.tool_calls} == {"get_time"}
    follow = client(disagg.url).chat.completions.create(model="tiny-llama", max_tokens=8, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in named.choices[0].message.tool_calls]},
        {"role": "tool", "tool_call_id": named.choices[0].message.tool_calls[0].id, "content": "12:00"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas_reassemble(disagg, colocated):
    got = {}
    for cluster in (disagg, colocated):
        stream = client(cluster.url).chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=160,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, stream=True)
        calls, finish = {}, None
        for chunk in stream:
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                    entry["id"] = d.id or entry["id"]
                    entry["name"] += (d.function.name or "") if d.function else ""
                    entry["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
        got[cluster.url] = calls[0]["arguments"]
    assert len(set(got.values())) == 1  # the same greedy call disaggregated and colocated


class Forecast(BaseModel):
    city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo"]})
    rainy: bool


def test_langchain_structured_output_and_bound_tools(disagg):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(base_url=disagg.url + "/v1", api_key="none", model="tiny-llama",
                                      max_tokens=120, temperature=0)
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke("Forecast for Paris?")
    assert isinstance(forecast, Forecast) and forecast.city in ("Paris", "Oslo")

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone (UTC or CET)."""
        return "12:00"

    message = llm.bind_tools([get_time], tool_choice="required", parallel_tool_calls=False).invoke("What time is it?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_time"
    assert message.tool_calls[0]["args"]["zone"] in ("UTC", "CET")


def test_auto_streams_text_at_once_and_holds_what_may_be_a_call():
    from router.tools.parse import Release

    r = Release()
    assert [r.add(x) for x in ["Hel", "lo <to", 'ol_call>{"a"', "}</tool_call>"]] == ["Hel", "lo ", "", ""]
    assert r.holding and r.held == '<tool_call>{"a"}</tool_call>'
    r = Release()
    assert [r.add(x) for x in [" ", '{"na', 'me"}']] == ["", "", ""] and r.holding
    r = Release()
    assert [r.add(x) for x in ["ab<", "c"]] == ["ab", "<c"] and not r.holding


def test_auto_with_tools_streams_content_as_it_comes(disagg):
    stream = client(disagg.url).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=40,
        temperature=0, stream=True)
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    text = "".join(deltas)
    assert not text.lstrip().startswith(("{", "[", "<"))  # (greedy on the tiny model: no call, plain text)
    assert len(deltas) > 5, deltas  # ...which streamed as it came, not held to the end
