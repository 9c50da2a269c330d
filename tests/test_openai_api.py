"""The OpenAI API as clients use it, through the official SDK with its defaults, in every mode:
disaggregated over tcp and shm, and colocated."""
import httpx
import openai
import pytest

from deploy.local import Cluster
from engine import EngineConfig, SamplingParams
from engine.generate import generate, generate_sequence
from engine.engine import Engine

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def shm_cluster():
    c = Cluster("--transport", "shm").wait_ready()
    yield c
    c.stop()


@pytest.fixture(params=["tcp", "shm", "colocated"])
def url(request, disagg, colocated):
    if request.param == "tcp":
        return disagg.url
    if request.param == "colocated":
        return colocated.url
    return request.getfixturevalue("shm_cluster").url


@pytest.fixture(scope="module")
def runner():
    return Engine(EngineConfig(threads=1))


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(chunks):
    """Text and finish reason per choice index, and the usage, from a stream of SDK chunks."""
    text, finish, usage = {}, {}, None
    for ch in chunks:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text[c.index] = text.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, finish, usage


def test_chat_without_max_tokens(url):
    c = client(url)
    r = c.chat.completions.create(model="tiny-llama", messages=CHAT, seed=5)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    assert r.choices[0].message.role == "assistant"
    s = c.chat.completions.create(model="tiny-llama", messages=CHAT, seed=5, stream=True,
                                  stream_options={"include_usage": True})
    text, finish, usage = streamed(s)
    assert finish[0] == r.choices[0].finish_reason and usage.completion_tokens == r.usage.completion_tokens


def test_completion_without_max_tokens_gives_sixteen(url):
    r = client(url).completions.create(model="tiny-llama", prompt="Hello", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_max_completion_tokens(url):
    c = client(url)
    r = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_completion_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    s = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_completion_tokens=5, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert streamed(s)[2].completion_tokens == 5


def test_n_choices_stream_and_not(url):
    c = client(url)
    kw = dict(model="tiny-llama", max_tokens=12, seed=11, temperature=1.0, extra_body={"ignore_eos": True})
    r = c.completions.create(prompt="Once", n=2, **kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    texts = {ch.index: ch.text for ch in r.choices}
    assert texts[0] != texts[1]
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 5
    text, finish, _ = streamed(c.completions.create(prompt="Once", n=2, stream=True, **kw))
    assert text == texts and finish == {0: "length", 1: "length"}
    single = c.completions.create(prompt="Once", **kw)
    assert single.choices[0].text == texts[0]
    chat = c.chat.completions.create(messages=CHAT, n=2, **kw)
    assert [ch.index for ch in chat.choices] == [0, 1]
    text, _, _ = streamed(c.chat.completions.create(messages=CHAT, n=2, stream=True, **kw))
    assert text == {ch.index: ch.message.content for ch in chat.choices}


def test_batched_prompts(url):
    c = client(url)
    kw = dict(model="tiny-llama", max_tokens=8, temperature=0)
    r = c.completions.create(prompt=["Hello", "abc"], n=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[2].text == c.completions.create(prompt="abc", **kw).choices[0].text
    assert r.choices[0].text == r.choices[1].text
    ids = c.completions.create(prompt=[[1, 75, 104], [1, 100]], **kw)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    text, finish, usage = streamed(c.completions.create(prompt=["Hello", "abc"], stream=True,
                                                        stream_options={"include_usage": True}, **kw))
    assert text == {0: r.choices[0].text, 1: r.choices[2].text} and usage.completion_tokens == 16


def test_seeded_sampling_repeats_and_penalties_change_it(url):
    c = client(url)
    kw = dict(model="tiny-llama", prompt="The", max_tokens=40, temperature=0.9, seed=1234, extra_body={"ignore_eos": True})
    a = c.completions.create(**kw).choices[0].text
    assert a == c.completions.create(**kw).choices[0].text
    assert a == "".join(streamed(c.completions.create(stream=True, **kw))[0].values())
    assert a != c.completions.create(**{**kw, "seed": 4321}).choices[0].text
    penalized = c.completions.create(frequency_penalty=1.5, presence_penalty=1.5, **kw).choices[0].text
    assert penalized != a
    greedy = dict(kw, temperature=0)
    rep = c.completions.create(**{**greedy, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.8}})
    assert rep.choices[0].text != c.completions.create(**greedy).choices[0].text


def test_logprobs_completions(url, runner):
    r = client(url).completions.create(model="tiny-llama", prompt="Hello", max_tokens=10, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(tl) for top, tl in zip(lp.top_logprobs, lp.token_logprobs))
    _, _, want = generate_sequence(runner, "Hello", SamplingParams(max_tokens=10, temperature=0, logprobs=3,
                                                                   ignore_eos=True))
    assert [e["lp"] for e in want] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_logprobs_chat_stream(url):
    s = client(url).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=6, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    entries = [e for ch in s for c in ch.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_echo(url):
    c = client(url)
    r = c.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0, echo=True, logprobs=1,
                             extra_body={"ignore_eos": True})
    plain = c.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Hello" + plain
    assert len(lp.tokens) == 6 + 4 and lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    text, _, _ = streamed(c.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0,
                                               echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert text[0] == "Hello" + plain


def test_stop_token_ids_and_min_tokens(url, runner):
    _, ids, _ = generate(runner, "Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_at = next(i for i in range(2, 12) if ids[i] not in ids[:i])
    c = client(url)
    kw = dict(model="tiny-llama", prompt="Hello", max_tokens=12, temperature=0)
    r = c.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [ids[stop_at]], "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == stop_at + 1
    longer = c.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [ids[stop_at]],
                                                    "min_tokens": stop_at + 1})
    assert longer.usage.completion_tokens > stop_at + 1


def test_chat_message_validation(disagg):
    c = client(disagg.url)
    for messages, param in [([{"role": "user"}], "messages.0"),
                            ([{"role": "system", "content": "x"}, {"role": "tool", "content": "r"}], "messages.1"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                             "messages.0.content")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
        assert e.value.status_code == 400 and (e.value.body or {}).get("param", "").startswith(param)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]}]
    kw = dict(model="tiny-llama", max_tokens=6, temperature=0)
    assert c.chat.completions.create(messages=parts, **kw).choices[0].message.content == \
        c.chat.completions.create(messages=[{"role": "user", "content": "Say something."}], **kw).choices[0].message.content
    assert httpx.get(disagg.url + "/health").json()["status"] == "ok"


def test_continue_final_message(disagg):
    c = client(disagg.url)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    r = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=3, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    closed = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == closed.usage.prompt_tokens - len("\n<|assistant|>\n")
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=3,
                                  extra_body={"continue_final_message": True})
