"""The nccl transport's same-GPU path (``kvtransfer.transports.nccl.same_gpu``) on the CPU: the protocol (a GRANT saying
``ipc``, the sender's export note, the receiver's ``copied``, END, ACK) with the CUDA IPC mapping replaced by the
buffer's bytes in the note, sender and receiver in one process. Bit-exact KV from layers, from the sender's slab
and from pool blocks into a buffer and into pool blocks; no pair formed, never an eager send. The real mapping runs
in tests/test_nccl.py on a GPU."""
import pytest
import torch

from engine.kv_pool import KVPool
from kvtransfer import Landing, PiecewiseKV, TransportConfig, make_receiver, make_sender
from kvtransfer.transports.nccl import same_gpu as nccl_same_gpu
from kvtransfer.tensors import layout_of, materialize


def kv(shape, seed):
    g = torch.Generator().manual_seed(seed)
    layers, heads, tokens, dim = shape
    return [tuple(torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16) for _ in range(2))
            for _ in range(layers)]


def same(want, got) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
               for pa, pb in zip(want, got) for a, b in zip(pa, pb))


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(nccl_same_gpu, "shares_gpu", lambda header, device, gpu_id: True)
    monkeypatch.setattr(nccl_same_gpu, "export", lambda buffer: {
        "handle": buffer.numpy().tobytes(), "size": buffer.numel(), "offset": 0, "counter": b"", "counter_offset": 0,
        "start": 0, "nbytes": buffer.numel()})
    monkeypatch.setattr(nccl_same_gpu, "mapped",
                        lambda note, device: torch.frombuffer(bytearray(note["handle"]), dtype=torch.uint8))
    cfg = TransportConfig(port=0, timeout_s=20, options={"device": "cpu", "nccl_backend": "gloo"})
    receiver, sender = make_receiver("nccl", cfg), make_sender("nccl", cfg)
    receiver.start()
    yield sender, receiver, receiver.address
    sender.close()
    receiver.close()


def test_layers_slab_and_blocks_arrive_bit_exact_through_the_mapping(pair):
    sender, receiver, dest = pair
    shape = (3, 2, 21, 8)
    want = kv(shape, 1)
    sender.send(dest, "layers", layout_of(want), want)
    source = sender.alloc(layout_of(want), "cpu").fill(want)
    sender.send(dest, "slab", source.layout, source.layers)
    source.release()
    pool = KVPool(3, 8, 4, 2, 8, torch.bfloat16, "cpu")
    table = [5, 2, 7, 0, 1, 3]
    pool.scatter(table, want)
    sender.send(dest, "blocks", layout_of(want), PiecewiseKV(layout_of(want), pool.pieces(table, 21)))
    for tid in ("layers", "slab", "blocks"):
        got = receiver.wait(tid, 20)
        assert same(want, materialize(got, "cpu")), tid
        got.release()
    assert sender.ipc_sends == receiver.ipc_receives == 3 and sender.eager_sends == 0
    assert sender.gathered_bytes == layout_of(want).total_nbytes  # the blocks, gathered once
    assert not sender.pairs.by_key or all(p._pg is None for p in sender.pairs.by_key.values())


def test_kv_lands_in_the_receivers_pool_blocks(pair):
    sender, receiver, dest = pair
    want = kv((2, 2, 13, 4), 2)
    mine = KVPool(2, 16, 8, 2, 4, torch.bfloat16, "cpu")
    table = [9, 3]
    receiver.land = lambda tid, layout: Landing(PiecewiseKV(layout, mine.pieces(table, 13)), lambda: None)
    sender.send(dest, "landed", layout_of(want), want)
    got = receiver.wait("landed", 20)
    assert got.landed is not None and same(want, mine.gather(table, 13))
    assert receiver.scattered_bytes == layout_of(want).total_nbytes
    got.release()
