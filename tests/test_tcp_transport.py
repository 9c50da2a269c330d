import socket
import threading
import time

import msgpack
import pytest
import torch

from kvtransfer import KVLayout, TransferError, TransportConfig, make_receiver, make_sender
from kvtransfer import frames
from kvtransfer.transports.tcp import parse_address
from kvtransfer.sockets import phases_from
from kvtransfer.tensors import layout_of, materialize


@pytest.fixture
def pair():
    receiver = make_receiver("tcp", TransportConfig(timeout_s=2.0, max_transfer_bytes=64 << 20, lease_s=5))
    receiver.start()
    sender = make_sender("tcp", TransportConfig(timeout_s=5.0))
    yield sender, receiver
    sender.close()
    receiver.close()


def random_kv(layers, heads, tokens, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    def one():
        return torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    return [(one(), one()) for _ in range(layers)]


def roundtrip(sender, receiver, kv, tid):
    sender.send(receiver.address, tid, layout_of(kv), kv)
    got = receiver.wait(tid, 5)
    layers = [(k.clone(), v.clone()) for k, v in materialize(got, "cpu")]
    got.release()
    return layers


def assert_bit_exact(a, b):
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a, b):
        assert ka.dtype == kb.dtype and ka.shape == kb.shape
        assert torch.equal(ka.view(torch.uint8), kb.reshape(ka.shape).view(torch.uint8))
        assert torch.equal(va.view(torch.uint8), vb.reshape(va.shape).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 2, 7, 16), (32, 3, 13, 5), (80, 1, 3, 8)])
def test_roundtrip_is_bit_exact(pair, dtype, shape):
    sender, receiver = pair
    kv = random_kv(*shape, dtype, seed=sum(shape))
    got = roundtrip(sender, receiver, kv, f"t-{dtype}-{shape}")
    assert_bit_exact(kv, got)


def test_special_values_survive(pair):
    sender, receiver = pair
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 65504.0]).view(1, 6, 1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kv = [(t.to(dtype), t.to(dtype).flip(1))]
        assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"special-{dtype}"))


def test_non_contiguous_sources_are_sent_correctly(pair):
    sender, receiver = pair
    base = torch.randn(4, 9, 2, dtype=torch.float16)
    k = base.transpose(0, 2).transpose(1, 2)
    assert not k.is_contiguous()
    kv = [(k, k * 2)]
    got = roundtrip(sender, receiver, kv, "strided")
    assert torch.equal(got[0][0], k) and torch.equal(got[0][1], k * 2)


def test_connection_is_reused_and_buffers_recycled(pair):
    sender, receiver = pair
    kv = random_kv(4, 2, 16, 8, torch.float16)
    for i in range(5):
        assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"reuse-{i}"))
    assert receiver.pool.allocations == 1 and receiver.pool.reuses == 4
    assert sum(len(v) for v in sender._idle.values()) == 1


def test_concurrent_transfers(pair):
    sender, receiver = pair
    kvs = [random_kv(3, 2, 10 + i, 4, torch.bfloat16, seed=i) for i in range(8)]
    threads = [threading.Thread(target=sender.send, args=(receiver.address, f"c{i}", layout_of(kv), kv))
               for i, kv in enumerate(kvs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, kv in enumerate(kvs):
        got = receiver.wait(f"c{i}", 5)
        assert_bit_exact(kv, materialize(got, "cpu"))
        got.release()
    assert receiver.pool.bytes_in_use == 0


def test_phases_are_recorded(pair):
    sender, receiver = pair
    kv = random_kv(8, 4, 64, 32, torch.float16)
    layout = layout_of(kv)
    sender.send(receiver.address, "ph", layout, kv)
    got = receiver.wait("ph", 5)
    materialize(got, "cpu")
    got.release()
    p = got.phases
    assert p.bytes == layout.total_nbytes
    assert p.wire > 0 and p.deserialize > 0 and p.d2h >= 0 and p.serialize > 0
    assert p.h2d == 0, "no host-to-device copy exists when decode runs on the CPU"
    assert p.total == pytest.approx(p.d2h + p.serialize + p.wire + p.deserialize + p.h2d)


def test_a_late_reader_keeps_the_senders_wire_time():
    """A receiver thread that reads BEGIN after the sender already pushed every byte sees less elapsed
    time than the sender's own work; the time the sender spent in its send calls is the floor."""
    sender = {"d2h": 0.1, "serialize": 1.8, "wire": 0.4, "overlap": 1.9, "setup": 0.0}
    p = phases_from(sender, elapsed_ms=0.5, nbytes=10)
    assert p.wire == pytest.approx(0.4)
    assert phases_from(sender, elapsed_ms=5.0, nbytes=10).wire == pytest.approx(3.1)


def test_layer_count_mismatch_is_refused(pair):
    sender, receiver = pair
    kv = random_kv(2, 1, 4, 4, torch.float32)
    layout = KVLayout(3, 1, 4, 4, "float32")
    with pytest.raises(TransferError):
        sender.send(receiver.address, "short", layout, kv)


def raw_conn(receiver):
    s = socket.create_connection(parse_address(receiver.address), timeout=5)
    return s


def begin(tid, layout):
    return frames.meta_frame(frames.BEGIN, {"tid": tid, "layout": layout.to_dict(), "meta": {}})


def assert_dropped(sock):
    """The receiver closes the connection (possibly after a NACK)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return
        if not chunk:
            break
        data += chunk
    if data:
        kind, status, length = frames.parse_prefix(data[:frames.PREFIX.size])
        assert kind == frames.ACK and status == 1
        assert "error" in msgpack.unpackb(data[frames.PREFIX.size:])


SMALL = KVLayout(2, 1, 4, 4, "float32")
MALFORMED = {
    "bad_magic": b"XXXX" + frames.prefix(frames.BEGIN, 0, 0)[4:],
    "wrong_version": frames.PREFIX.pack(frames.MAGIC, 99, frames.BEGIN, 0, 0, 0),
    "unknown_kind": frames.PREFIX.pack(frames.MAGIC, frames.WIRE_VERSION, 77, 0, 0, 0),
    "layer_before_begin": frames.prefix(frames.LAYER, 0, 16),
    "meta_over_limit": frames.prefix(frames.BEGIN, 0, 1 << 40),
    "meta_not_msgpack": frames.prefix(frames.BEGIN, 0, 4) + b"\xc1\xc1\xc1\xc1",
    "meta_not_a_map": frames.meta_frame(frames.BEGIN, [1, 2]),
    "no_tid": frames.meta_frame(frames.BEGIN, {"layout": SMALL.to_dict()}),
    "bad_layout": frames.meta_frame(frames.BEGIN, {"tid": "x", "layout": {"v": 1, "layers": -3}}),
    "declared_size_over_limit": begin("huge", KVLayout(1024, 64, 256, 4096, "float32")),
    "wrong_layer_index": begin("idx", SMALL) + frames.prefix(frames.LAYER, 1, SMALL.layer_nbytes),
    "wrong_layer_size": begin("size", SMALL) + frames.prefix(frames.LAYER, 0, SMALL.layer_nbytes + 1),
    "garbage": bytes(range(256)) * 4,
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_drop_the_connection_not_the_receiver(pair, name):
    sender, receiver = pair
    with raw_conn(receiver) as s:
        s.sendall(MALFORMED[name])
        assert_dropped(s)
    kv = random_kv(2, 1, 4, 4, torch.float32)
    assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"after-{name}"))


def test_truncated_transfer_fails_the_transfer(pair):
    sender, receiver = pair
    with raw_conn(receiver) as s:
        s.sendall(begin("trunc", SMALL) + frames.prefix(frames.LAYER, 0, SMALL.layer_nbytes) + b"\0" * 10)
    with pytest.raises(TransferError):
        receiver.wait("trunc", 5)
    assert receiver.pool.bytes_in_use == 0


def test_stalled_sender_times_out(pair):
    sender, receiver = pair
    with raw_conn(receiver) as s:
        s.sendall(begin("stall", SMALL))
        start = time.monotonic()
        with pytest.raises(TransferError):
            receiver.wait("stall", 10)
        assert time.monotonic() - start < 5
    assert receiver.pool.bytes_in_use == 0


def test_receiver_abort_fails_waiter_and_frees_result(pair):
    sender, receiver = pair
    kv = random_kv(2, 1, 4, 4, torch.float32)
    sender.send(receiver.address, "ab", layout_of(kv), kv)
    receiver.abort("ab")
    with pytest.raises(TransferError):
        receiver.wait("ab", 1)
    assert receiver.pool.bytes_in_use == 0


def test_wait_for_unknown_transfer_times_out(pair):
    _, receiver = pair
    with pytest.raises(TimeoutError):
        receiver.wait("never", 0.2)


def test_unknown_transport_and_missing_dependency_messages():
    from kvtransfer import registry
    with pytest.raises(ValueError, match="unknown transport"):
        make_sender("carrier-pigeon")
    registry.TRANSPORTS["fake"] = registry.TransportSpec("kvtransfer_missing_module", "A", "B", "pip install fake")
    try:
        with pytest.raises(registry.TransportUnavailable, match="pip install fake"):
            make_sender("fake")
    finally:
        del registry.TRANSPORTS["fake"]


def test_layers_streamed_from_a_generator_arrive_like_a_list(pair):
    sender, receiver = pair
    kv = random_kv(5, 2, 9, 8, torch.bfloat16, seed=11)
    sender.send(receiver.address, "gen", layout_of(kv), (layer for layer in kv))
    got = receiver.wait("gen", 5)
    streamed = [(k.clone(), v.clone()) for k, v in materialize(got, "cpu")]
    got.release()
    assert_bit_exact(kv, streamed)
    assert_bit_exact(kv, roundtrip(sender, receiver, kv, "list"))
