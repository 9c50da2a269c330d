"""KV straight from and into paged-pool blocks: senders that take pieces (tcp, shm, nixl, arrow) and the receivers'
landing hook, bit-exact for every dtype, with the reservation undone when a transfer fails or is aborted."""
import importlib.util
import threading

import pytest
import torch

from kvtransfer import KVLayout, Landing, PiecewiseKV, TransferError, TransportConfig, make_receiver, make_sender
from kvtransfer.tensors import TORCH_DTYPES, materialize

BLOCK = 16


def pool(layout: KVLayout, blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, layout.num_kv_heads, layout.head_dim)
    dtype = TORCH_DTYPES[layout.dtype]
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layout.num_layers)]


def pieces_of(layers, table, tokens):
    sizes = [min(BLOCK, tokens - i * BLOCK) for i in range(len(table))]
    return [([k[b, :n] for b, n in zip(table, sizes)], [v[b, :n] for b, n in zip(table, sizes)]) for k, v in layers]


def pool_in(memory: torch.Tensor, dtype):
    """A 3-layer pool of 6 blocks (2 KV heads, head dim 8) laid out in ``memory`` (what a worker shares)."""
    n = 6 * BLOCK * 2 * 8 * dtype.itemsize
    views = [memory[i * n:(i + 1) * n].view(dtype).view(6, BLOCK, 2, 8) for i in range(6)]
    return list(zip(views[0::2], views[1::2]))


def expected(layers, table, tokens):
    return [(torch.cat(ks), torch.cat(vs)) for ks, vs in pieces_of(layers, table, tokens)]


@pytest.fixture
def tcp():
    receiver = make_receiver("tcp", TransportConfig(timeout_s=3.0))
    receiver.start()
    sender = make_sender("tcp", TransportConfig(timeout_s=5.0))
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 16, 37])
@pytest.mark.parametrize("name", ["tcp", "shm", pytest.param("arrow", marks=pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed"))])
def test_pieces_sent_from_blocks_arrive_bit_exact(name, tokens, dtype):
    layout = KVLayout(3, 2, 8, tokens, dtype)
    source = pool(layout, 8, seed=tokens)
    table = [5, 1, 6][: -(-tokens // BLOCK)]
    receiver = make_receiver(name, TransportConfig(timeout_s=3.0, options={"shm_bytes": 16 << 20}))
    receiver.start()
    sender = make_sender(name, TransportConfig(timeout_s=5.0))
    try:
        assert sender.sends_pieces
        sender.send(receiver.address, "p", layout, PiecewiseKV(layout, pieces_of(source, table, tokens)))
        got = materialize(receiver.wait("p", 5), "cpu")
    finally:
        sender.close()
        receiver.close()
    for (k, v), (ek, ev) in zip(got, expected(source, table, tokens)):
        assert torch.equal(k.view(torch.uint8), ek.view(torch.uint8)) and torch.equal(v.view(torch.uint8), ev.view(torch.uint8))


@pytest.fixture(params=["tcp", pytest.param("arrow", marks=pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed"))])
def landing_pair(request):
    receiver = make_receiver(request.param, TransportConfig(timeout_s=3.0))
    receiver.start()
    sender = make_sender(request.param, TransportConfig(timeout_s=5.0))
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_receiver_lands_bytes_in_the_blocks_the_hook_names(landing_pair, dtype):
    """Pieces of blocks, then whole tensors (one run a layer, cut across the blocks), land in the named blocks."""
    sender, receiver = landing_pair
    layout = KVLayout(4, 2, 8, 40, dtype)
    source = pool(layout, 6, seed=1)
    dest = [tuple(torch.zeros_like(t) for t in pair) for pair in pool(layout, 6, seed=2)]
    table, released = [4, 0, 3], []
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(dest, table, lay.num_tokens)),
                                             lambda: released.append(tid))
    sender.send(receiver.address, "land", layout, PiecewiseKV(layout, pieces_of(source, [1, 2, 5], 40)))
    received = receiver.wait("land", 5)
    assert received.landed is not None and received.buffer is None
    for (k, v), (ek, ev) in zip(expected(dest, table, 40), expected(source, [1, 2, 5], 40)):
        assert torch.equal(k.view(torch.uint8), ek.view(torch.uint8)) and torch.equal(v.view(torch.uint8), ev.view(torch.uint8))
    assert not dest[0][0][1].any(), "a block outside the table was written"
    received.release()
    assert released == ["land"]
    for k, v in dest:
        k.zero_()
        v.zero_()
    whole = expected(source, [1, 2, 5], 40)
    sender.send(receiver.address, "land-whole", layout, whole)
    received = receiver.wait("land-whole", 5)
    assert received.landed is not None
    for (k, v), (ek, ev) in zip(expected(dest, table, 40), whole):
        assert torch.equal(k.view(torch.uint8), ek.view(torch.uint8)) and torch.equal(v.view(torch.uint8), ev.view(torch.uint8))
    received.release()


def test_landing_is_released_when_the_sender_dies_midway(tcp):
    sender, receiver = tcp
    layout = KVLayout(6, 2, 8, 20, "float32")
    dest = pool(layout, 4, seed=3)
    released = threading.Event()
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(dest, [0, 1], 20)), released.set)
    k = torch.ones(20, 2, 8)

    def dying():
        yield k, k
        yield k, k
        raise RuntimeError("prefill died")

    with pytest.raises(Exception):
        sender.send(receiver.address, "dead", layout, dying())
    assert released.wait(5)
    with pytest.raises(TransferError):
        receiver.wait("dead", 5)


def test_no_landing_falls_back_to_the_pool_buffer(tcp):
    sender, receiver = tcp
    layout = KVLayout(2, 1, 4, 5, "float16")
    receiver.land = lambda tid, lay: None
    kv = [(torch.randn(5, 1, 4).half(), torch.randn(5, 1, 4).half()) for _ in range(2)]
    sender.send(receiver.address, "fb", layout, kv)
    received = receiver.wait("fb", 5)
    assert received.landed is None and (received.buffer is not None or received.layers is not None)
    assert all(torch.equal(a, b) for pair, got in zip(kv, materialize(received, "cpu")) for a, b in zip(pair, got))


def test_pieces_that_do_not_fit_the_layout_are_refused(tcp):
    sender, receiver = tcp
    layout = KVLayout(1, 2, 8, 20, "float32")
    short = PiecewiseKV(layout, [([torch.zeros(16, 2, 8)], [torch.zeros(16, 2, 8)])])
    with pytest.raises(TransferError, match="tokens"):
        sender.send(receiver.address, "short", layout, short)


@pytest.mark.parametrize("source", ["pieces", "tensors"])
def test_shm_writes_straight_into_a_shared_pool(source):
    from kvtransfer.transports.shm import SharedMemory

    layout = KVLayout(3, 2, 8, 37, "bfloat16")
    dtype, shape = torch.bfloat16, (6, BLOCK, 2, 8)
    shared = SharedMemory(2 * 3 * 6 * BLOCK * 2 * 8 * 2)
    n = 6 * BLOCK * 2 * 8 * 2
    views = [shared.tensor[i * n:(i + 1) * n].view(dtype).view(shape) for i in range(6)]
    dest = list(zip(views[0::2], views[1::2]))
    table, released = [5, 0, 2], []
    receiver = make_receiver("shm", TransportConfig(timeout_s=3.0, options={"shm_bytes": 1 << 20}))
    receiver.share(shared)
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(dest, table, lay.num_tokens)),
                                             lambda: released.append(tid))
    receiver.start()
    sender = make_sender("shm", TransportConfig(timeout_s=5.0))
    src = pool(layout, 4, seed=9)
    kv = PiecewiseKV(layout, pieces_of(src, [3, 1, 0], 37)) if source == "pieces" else expected(src, [3, 1, 0], 37)
    try:
        sender.send(receiver.address, "s", layout, kv)
        received = receiver.wait("s", 5)
    finally:
        sender.close()
        receiver.close()
        shared.close()
    assert received.landed is not None and received.buffer is None
    for (k, v), (ek, ev) in zip(expected(dest, table, 37), expected(src, [3, 1, 0], 37)):
        assert torch.equal(k.view(torch.uint8), ek.view(torch.uint8)) and torch.equal(v.view(torch.uint8), ev.view(torch.uint8))
    assert not dest[0][0][1].any()
    received.release()
    assert released == ["s"]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed")
@pytest.mark.parametrize("placed", [False, True])
def test_nixl_writes_straight_into_a_registered_pool(placed):
    layout = KVLayout(3, 2, 8, 37, "float16")
    memory = torch.zeros(2 * 3 * 6 * BLOCK * 2 * 8 * 2, dtype=torch.uint8)
    dest = pool_in(memory, torch.float16)
    table, released = [4, 1, 3], []
    opts = {"nixl_pool_bytes": 8 << 20}
    receiver = make_receiver("nixl", TransportConfig(timeout_s=5.0, options=opts))
    receiver.share(memory)
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(dest, table, lay.num_tokens)),
                                             lambda: released.append(tid))
    receiver.start()
    sender = make_sender("nixl", TransportConfig(timeout_s=5.0, options=opts))
    src = expected(pool(layout, 4, seed=11), [2, 0, 3], 37)
    try:
        kv = sender.alloc(layout).fill(src) if placed else src
        sender.send(receiver.address, "n", layout, kv)
        received = receiver.wait("n", 5)
        assert receiver.registrations == 2
    finally:
        sender.close()
        receiver.close()
    assert received.landed is not None and received.buffer is None
    for (k, v), (ek, ev) in zip(expected(dest, table, 37), src):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    assert not dest[0][0][0].any()
    received.release()
    assert released == ["n"]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed")
@pytest.mark.parametrize("into_blocks", [False, True])
def test_nixl_sends_from_a_registered_prefill_pool(into_blocks):
    layout = KVLayout(3, 2, 8, 37, "bfloat16")
    src_memory, dst_memory = (torch.zeros(2 * 3 * 6 * BLOCK * 2 * 8 * 2, dtype=torch.uint8) for _ in range(2))
    src, dest = pool_in(src_memory, torch.bfloat16), pool_in(dst_memory, torch.bfloat16)
    for (k, v), (rk, rv) in zip(src, pool(layout, 6, seed=3)):
        k.copy_(rk)
        v.copy_(rv)
    opts = {"nixl_pool_bytes": 8 << 20}
    receiver = make_receiver("nixl", TransportConfig(timeout_s=5.0, options=opts))
    if into_blocks:
        receiver.share(dst_memory)
        receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(dest, [0, 5, 2], 37)), lambda: None)
    receiver.start()
    sender = make_sender("nixl", TransportConfig(timeout_s=5.0, options=opts))
    sender.share(src_memory)
    try:
        assert sender.takes_pieces("cpu") and sender.registrations == 2
        sender.send(receiver.address, "n", layout, PiecewiseKV(layout, pieces_of(src, [4, 1, 2], 37)))
        received = receiver.wait("n", 5)
        got = expected(dest, [0, 5, 2], 37) if into_blocks else materialize(received, "cpu")
        assert sender.staged_bytes == 0 and (received.landed is not None) == into_blocks
    finally:
        sender.close()
        receiver.close()
    for (k, v), (ek, ev) in zip(got, expected(src, [4, 1, 2], 37)):
        assert torch.equal(k.view(torch.uint8), ek.view(torch.uint8)) and torch.equal(v.view(torch.uint8), ev.view(torch.uint8))
    received.release()
