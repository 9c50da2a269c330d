"""Arrow Flight specifics beyond the conformance suite: parallel streams, a
transfer's parts that never all arrive, whole layers handed over without a
receiver-side copy, and the receiver's heap setting."""
import importlib.util
import threading
import time

import msgpack
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")

from kvtransfer import KVLayout, Landing, PiecewiseKV, TransferError, TransportConfig, make_receiver, make_sender  # noqa: E402
from kvtransfer.tensors import layout_of, materialize  # noqa: E402
from tests.test_conformance import assert_bit_exact, random_kv, roundtrip  # noqa: E402
from tests.test_pieces import expected, pieces_of, pool  # noqa: E402


@pytest.fixture
def receiver():
    r = make_receiver("arrow", TransportConfig(timeout_s=2.0, lease_s=10))
    r.start()
    yield r
    r.close()


@pytest.mark.parametrize("streams", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_streams_arrive_bit_exact(receiver, streams, dtype):
    sender = make_sender("arrow", TransportConfig(timeout_s=10, options={"arrow_streams": streams}))
    try:
        for i, shape in enumerate([(7, 2, 300, 16), (1, 1, 1, 1), (2, 8, 64, 8)]):
            kv = random_kv(*shape, dtype, seed=i)
            assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"p{i}")[0])
    finally:
        sender.close()


def test_parallel_streams_from_pool_blocks_into_landing_blocks(receiver):
    layout = KVLayout(5, 2, 8, 37, "bfloat16")
    source, target = pool(layout, 8, seed=7), pool(layout, 8, seed=8)
    released = threading.Event()
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(target, [4, 0, 2], lay.num_tokens)), released.set)
    sender = make_sender("arrow", TransportConfig(timeout_s=10, options={"arrow_streams": 2}))
    try:
        sender.send(receiver.address, "b", layout, PiecewiseKV(layout, pieces_of(source, [1, 6, 3], layout.num_tokens)))
        got = receiver.wait("b", 5)
        assert got.landed is not None and not released.is_set()
        for (k, v), (ek, ev) in zip(expected(target, [4, 0, 2], 37), expected(source, [1, 6, 3], 37)):
            assert torch.equal(k, ek) and torch.equal(v, ev)
    finally:
        sender.close()


def test_whole_layers_are_handed_over_without_a_receiver_copy(receiver):
    kv = random_kv(4, 8, 512, 64, torch.bfloat16, seed=3)
    sender = make_sender("arrow", TransportConfig(timeout_s=10))
    try:
        sender.send(receiver.address, "z", layout_of(kv), kv)
        got = receiver.wait("z", 5)
        assert got.layers is not None and receiver.pool.allocations == 0
        assert_bit_exact(kv, materialize(got, "cpu"))
        got.release()
    finally:
        sender.close()


def test_a_part_that_never_arrives_fails_the_transfer_and_frees_the_landing(receiver):
    """Only part 0 of 2 is sent: the receiver gives up after its timeout and lets the landing go."""
    import pyarrow as pa
    import pyarrow.flight as fl

    from kvtransfer.transports.arrow.wire import VERSION, aligning_metadata, column, schema_for

    layout = KVLayout(2, 1, 4, 8, "float32")
    released = threading.Event()
    target = pool(layout, 4, seed=1)
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(target, [0], lay.num_tokens)), released.set)
    client = fl.FlightClient(f"grpc+tcp://{receiver.address}")
    header = msgpack.packb({"v": VERSION, "tid": "half", "meta": {}, "part": 0, "parts": 2})
    writer, reader = client.do_put(fl.FlightDescriptor.for_command(header), schema_for(layout))
    k = torch.randn(8, 1, 4)
    raw = memoryview(k.numpy()).cast("B")
    writer.write_with_metadata(pa.RecordBatch.from_arrays([column(raw), column(raw)], schema=schema_for(layout)),
                               pa.py_buffer(aligning_metadata({"layer": 0, "at": 0, "t": [0, 0, 0]}, len(raw))))
    writer.done_writing()
    assert reader.read() is None
    with pytest.raises(fl.FlightError, match="never arrived"):
        writer.close()
    assert released.wait(5)
    with pytest.raises(TransferError):
        receiver.wait("half", 1)
    # the receiver keeps serving
    sender = make_sender("arrow", TransportConfig(timeout_s=10))
    try:
        sender.send(receiver.address, "whole", layout, [(k, k), (k, k)])
        receiver.wait("whole", 5).release()
    finally:
        sender.close()
        client.close()


@pytest.mark.parametrize("schema", ["bare", "other columns"])
def test_a_stream_without_the_layout_in_its_schema_is_refused_and_the_receiver_keeps_serving(receiver, schema):
    import pyarrow as pa
    import pyarrow.flight as fl

    from kvtransfer.transports.arrow.wire import SCHEMA, VERSION, layout_dict, schema_for

    layout = KVLayout(2, 1, 4, 8, "bfloat16")
    assert layout_dict(schema_for(layout)) == layout.to_dict()
    declared = SCHEMA if schema == "bare" else pa.schema([("k", pa.float32())]).with_metadata(
        schema_for(layout).metadata)
    client = fl.FlightClient(f"grpc+tcp://{receiver.address}")
    header = msgpack.packb({"v": VERSION, "tid": "no-layout", "meta": {}, "part": 0, "parts": 1})
    writer, reader = client.do_put(fl.FlightDescriptor.for_command(header), declared)
    with pytest.raises(fl.FlightError, match="pdserve.layout|two uint8 columns"):
        writer.done_writing()
        reader.read()
        writer.close()
    client.close()
    assert receiver.refused == 1
    kv = random_kv(2, 1, 8, 4, torch.bfloat16, seed=3)
    sender = make_sender("arrow", TransportConfig(timeout_s=10))
    try:
        sender.send(receiver.address, "after", layout, kv)
        got = receiver.wait("after", 5)
        assert_bit_exact(kv, materialize(got, "cpu"))
        got.release()
    finally:
        sender.close()


def test_the_call_setup_before_the_handler_runs_counts_as_wire(receiver, monkeypatch):
    """The receiver's clock starts when its handler runs; a call that took 200 ms to get there is still in the
    record (from the batches' ``e``), and the record never exceeds the sender's own wall time."""
    import time

    sender = make_sender("arrow", TransportConfig(timeout_s=10))
    connect = sender._connect

    class SlowCall:
        def __init__(self, inner):
            self.inner = inner

        def do_put(self, *args, **kwargs):
            time.sleep(0.2)
            return self.inner.do_put(*args, **kwargs)

        def close(self):
            self.inner.close()

    monkeypatch.setattr(sender, "_connect", lambda dest, n: SlowCall(connect(dest, n)))
    layout = KVLayout(2, 1, 4, 8, "float32")
    kv = random_kv(2, 1, 8, 4, torch.float32)
    try:
        start = time.perf_counter()
        sender.send(receiver.address, "slow", layout, kv)
        wall = (time.perf_counter() - start) * 1e3
        got = receiver.wait("slow", 5)
        assert 200 <= got.phases.wire and got.phases.total <= wall
        got.release()
    finally:
        sender.close()


def test_a_send_in_flight_keeps_its_connection_and_another_gets_its_own(receiver):
    """gRPC would multiplex concurrent calls over one connection; each send in flight checks out its own client
    and gives it back for the next."""
    layout = KVLayout(2, 1, 4, 8, "float32")
    kv = [random_kv(2, 1, 8, 4, torch.float32, seed=s) for s in range(3)]
    sender = make_sender("arrow", TransportConfig(timeout_s=10))
    made, connect, go = [], sender._connect, threading.Event()
    sender._connect = lambda dest, n: made.append(n) or connect(dest, n)

    def held_back():
        yield kv[0][0]
        go.wait(10)
        yield kv[0][1]

    first = threading.Thread(target=sender.send, args=(receiver.address, "held", layout, held_back()))
    try:
        first.start()
        deadline = time.monotonic() + 10
        while not made and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.send(receiver.address, "beside", layout, kv[1])
        go.set()
        first.join(10)
        sender.send(receiver.address, "after", layout, kv[2])
        assert made == [0, 1]
        for tid, want in (("held", kv[0]), ("beside", kv[1]), ("after", kv[2])):
            got = receiver.wait(tid, 5)
            assert_bit_exact(want, materialize(got, "cpu"))
            got.release()
    finally:
        go.set()
        sender.close()


HEAP_PROBE = """
import ctypes, sys
from kvtransfer import TransportConfig, make_receiver

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
r = make_receiver("arrow", TransportConfig(options={"arrow_keep_heap": sys.argv[1]}))
r.start()
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
r.close()
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize("keep,mapped", [("yes", 0), ("no", 1)])
def test_receiver_keeps_large_blocks_in_the_heap(keep, mapped):
    """gRPC's multi-megabyte receive buffers come from malloc: with the receiver's default they come from the heap
    (pages already faulted in by the last transfer), not from a fresh mmap each time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, keep], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == mapped
