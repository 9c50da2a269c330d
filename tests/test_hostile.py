"""Hostile input: malformed HTTP requests get 4xx with an OpenAI-style error body and the
server keeps serving; garbage and stalls on the control and data ports drop only that
connection; the frame and message decoders survive fuzzing."""
import socket
import struct
import time

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control import messages
from kvtransfer import KVLayout, LayoutError, TransportConfig, frames, make_receiver, make_sender
from kvtransfer.tensors import layout_of
from tests.test_auth import KV
from tests.test_failures import eventually

OK = {"model": "tiny-llama", "prompt": "x"}
RAW = [  # (path, body bytes, content-type, expected status)
    ("/v1/completions", b"\xff\xfe{not utf-8", "application/json", 400),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\xc3\x28"}', "application/json", 400),
    ("/v1/completions", b"[]", "application/json", 400),
    ("/v1/completions", b"null", "application/json", 400),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x"', "application/json", 400),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, "application/json", 400),
    ("/v1/completions", b"{}" + b" " * (9 << 20), "application/json", 413),
    ("/v1/chat/completions", b"", "application/json", 400),
]
JSON = [  # (path, body, expected status)
    ("/v1/completions", {**OK, "prompt": ""}, 400),
    ("/v1/completions", {**OK, "prompt": []}, 400),
    ("/v1/completions", {**OK, "prompt": 42}, 400),
    ("/v1/completions", {**OK, "prompt": [[1, 2], []]}, 400),
    ("/v1/completions", {**OK, "prompt": [-5]}, 400),
    ("/v1/completions", {**OK, "prompt": "\u4e16" * 600000}, 400),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400),
    ("/v1/completions", {**OK, "max_tokens": 1.5}, 400),
    ("/v1/completions", {**OK, "max_tokens": 10 ** 30}, 400),
    ("/v1/completions", {**OK, "temperature": -0.1}, 400),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400),
    ("/v1/completions", {**OK, "seed": 2 ** 70}, 400),
    ("/v1/completions", {**OK, "stop": ["s"] * 17}, 400),
    ("/v1/completions", {**OK, "stop": "s" * 300}, 400),
    ("/v1/completions", {**OK, "stop": 7}, 400),
    ("/v1/completions", {**OK, "stream": {"a": 1}}, 400),
    ("/v1/completions", {**OK, "stream": True, "stream_options": {"include_usage": "yes"}}, 400),
    ("/v1/completions", {**OK, "stream": True, "stream_options": {"bogus": True}}, 400),
    ("/v1/completions", {**OK, "logprobs": 21}, 400),
    ("/v1/completions", {**OK, "echo": [1]}, 400),
    ("/v1/completions", {**OK, "n": 0}, 400),
    ("/v1/completions", {**OK, "prompt": ["a"] * 8, "n": 9}, 400),
    ("/v1/completions", {**OK, "model": ["tiny-llama"]}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"content": "hi"}]}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "assistant", "content": None}]}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": "hi"}, 400),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
]


def still_serving(url):
    r = httpx.post(url + "/v1/completions", json={**OK, "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def assert_openai_error(r, status):
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]


@pytest.mark.parametrize("path,body,ctype,status", RAW, ids=[f"raw{i}" for i in range(len(RAW))])
def test_malformed_bodies(disagg, path, body, ctype, status):
    r = httpx.post(disagg.url + path, content=body, headers={"content-type": ctype}, timeout=30)
    assert_openai_error(r, status)
    still_serving(disagg.url)


@pytest.mark.parametrize("path,body,status", JSON, ids=[f"json{i}" for i in range(len(JSON))])
def test_invalid_fields(disagg, path, body, status):
    r = httpx.post(disagg.url + path, json=body, timeout=30)
    assert_openai_error(r, status)
    still_serving(disagg.url)


def test_chunked_body_over_the_limit_is_413(disagg):
    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = httpx.post(disagg.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 413)
    still_serving(disagg.url)


def test_wrong_method_and_path(disagg):
    assert httpx.get(disagg.url + "/v1/completions").status_code == 405
    assert httpx.post(disagg.url + "/v2/nothing", json=OK).status_code == 404
    still_serving(disagg.url)


def worker_address(cluster, role):
    return httpx.get(cluster.url + "/health").json()["workers"][role][0]


def test_garbage_on_the_control_port(disagg):
    host, port = worker_address(disagg, "decode")["address"][len("tcp://"):].rsplit(":", 1)
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff" + b"\x00" * 8 + b"\x7f" + b"A" * 1000, bytes(range(256))):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            time.sleep(0.05)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{host}:{port}")
    for raw in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 9, "op": "ping"}), b"x" * 100000):
        dealer.send(raw)
    dealer.send_multipart([b"a", b"b", b"c"])
    dealer.close()
    oversized = ctx.socket(zmq.DEALER)
    oversized.setsockopt(zmq.LINGER, 0)
    oversized.connect(f"tcp://{host}:{port}")
    oversized.send(b"\x00" * (messages.MAX_MESSAGE_BYTES + 1))
    time.sleep(0.2)
    oversized.close()
    time.sleep(0.3)
    assert worker_address(disagg, "decode")["healthy"]
    still_serving(disagg.url)


@pytest.fixture
def receiver():
    r = make_receiver("tcp", TransportConfig(timeout_s=1.0, max_transfer_bytes=1 << 20, options={"idle_s": 1.5}))
    r.start()
    yield r
    r.close()


def _connect(receiver):
    host, port = receiver.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


DATA_JUNK = [
    b"GARBAGE" * 10,
    struct.pack("!4sHBBIQ", b"XXXX", 2, 1, 0, 0, 10),
    struct.pack("!4sHBBIQ", b"PDKV", 99, 1, 0, 0, 10),
    struct.pack("!4sHBBIQ", b"PDKV", 2, 42, 0, 0, 10),
    frames.prefix(frames.BEGIN, 0, 1 << 40),
    frames.meta_frame(frames.BEGIN, {"tid": "t", "layout": {"num_layers": 10 ** 9, "num_kv_heads": 8, "tokens": 10 ** 6,
                                                           "head_dim": 128, "dtype": "float16"}}),
    frames.meta_frame(frames.BEGIN, {"tid": 5}),
    frames.meta_frame(frames.BEGIN, ["not", "a", "map"]),
    frames.prefix(frames.BEGIN, 0, 8) + b"\xc1" * 8,
]


@pytest.mark.parametrize("junk", DATA_JUNK, ids=[f"junk{i}" for i in range(len(DATA_JUNK))])
def test_garbage_on_the_data_port_drops_only_that_connection(receiver, junk):
    with _connect(receiver) as s:
        s.sendall(junk)
        s.settimeout(3)
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
    assert eventually(lambda: receiver.dropped_connections >= 1, 2)
    sender = make_sender("tcp", TransportConfig(timeout_s=5))
    try:
        sender.send(receiver.address, "fine", layout_of(KV), KV)
        receiver.wait("fine", 5).release()
    finally:
        sender.close()
    assert receiver.pool.bytes_held <= layout_of(KV).total_nbytes * 2


@pytest.mark.parametrize("stall", [b"", b"PD", frames.meta_frame(frames.BEGIN, {"tid": "slow", "layout": layout_of(KV).to_dict()})])
def test_slowloris_connections_are_closed(receiver, stall):
    with _connect(receiver) as s:
        s.sendall(stall)
        s.settimeout(10)
        started = time.monotonic()
        try:
            assert s.recv(4096) is not None
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 5
    if stall.startswith(frames.MAGIC) and len(stall) > 20:
        assert receiver.poll("slow").value == "failed"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_message_decoder(raw):
    try:
        msg = messages.decode(raw)
    except messages.MessageError:
        return
    assert isinstance(msg, dict) and msg["v"] == messages.VERSION and isinstance(msg["op"], str)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=8), st.binary(max_size=8),
                                                       st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=3)), max_size=6))
def test_fuzz_message_maps(fields):
    try:
        messages.decode(msgpack.packb({"v": messages.VERSION, **fields}, use_bin_type=True))
    except messages.MessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-9, 9), st.text(max_size=4),
                          st.dictionaries(st.sampled_from(["op", "rid", "ids"]),
                                          st.one_of(st.text(max_size=6), st.integers(-9, 9), st.just("batch")))),
                max_size=4))
def test_fuzz_batches(items):
    msg = messages.decode(messages.encode("batch", msgs=items))
    try:
        out = messages.unbatch(msg)
    except messages.MessageError:
        return
    assert all(isinstance(m["op"], str) and m["op"] != "batch" and isinstance(m["rid"], str) for m in out)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=20, max_size=20))
def test_fuzz_frame_prefix(raw):
    try:
        kind, a, b = frames.parse_prefix(raw)
    except frames.FrameError:
        return
    assert kind in frames.KINDS


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["num_layers", "num_kv_heads", "tokens", "head_dim", "dtype", "x"]),
                       st.one_of(st.integers(-5, 1 << 40), st.text(max_size=10), st.none(), st.floats()), max_size=6))
def test_fuzz_layout(d):
    try:
        layout = KVLayout.from_dict(d)
    except LayoutError:
        return
    assert layout.total_nbytes > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=300))
def test_fuzz_live_data_port(receiver, junk):
    with _connect(receiver) as s:
        try:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(3)
            while s.recv(4096):
                pass
        except OSError:
            pass
    assert receiver._server is not None
