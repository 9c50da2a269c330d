"""One suite every transport passes: bit-exact round trips for every dtype and
shape range, non-contiguous sources, concurrency, abort, a sender killed
mid-transfer, and the size limit."""
import importlib.util
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvtransfer import KVLayout, TransferError, TransportConfig, make_receiver, make_sender
from kvtransfer.tensors import layout_of, materialize
from tests.transports import MlxWorld, ProxySender, available, send_placed

LIMIT = 256 << 20
OWNS_MEMORY = {"nixl", "mlx", "nccl"}


@pytest.fixture(scope="session")
def mlx_world(tmp_path_factory):
    world = MlxWorld(str(tmp_path_factory.mktemp("mlx")))
    yield world
    world.close()


@pytest.fixture(params=available())
def pair(request):
    name = request.param
    options = {"shm_bytes": 512 << 20, "nixl_pool_bytes": 64 << 20}
    if name == "ray":
        request.getfixturevalue("ray_cluster")
    if name == "mlx":
        world = request.getfixturevalue("mlx_world")
        options.update(world.options)
    receiver = make_receiver(name, TransportConfig(timeout_s=3.0, lease_s=10, max_transfer_bytes=LIMIT, options=options))
    receiver.start()
    sender = ProxySender(world) if name == "mlx" else make_sender(name, TransportConfig(timeout_s=10.0, options=options))
    yield name, sender, receiver
    sender.close()
    receiver.close()


def random_kv(layers, heads, tokens, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(tokens, heads, head_dim, generator=g).to(dtype) for _ in range(2)) for _ in range(layers)]


def roundtrip(sender, receiver, kv, tid):
    sender.send(receiver.address, tid, layout_of(kv), kv)
    got = receiver.wait(tid, 10)
    layers = [(k.clone(), v.clone()) for k, v in materialize(got, "cpu")]
    got.release()
    return layers, got.phases


def assert_bit_exact(want, got):
    assert len(want) == len(got)
    for pair_w, pair_g in zip(want, got):
        for w, g in zip(pair_w, pair_g):
            assert w.dtype == g.dtype and tuple(w.shape) == tuple(g.shape)
            assert torch.equal(w.contiguous().view(torch.uint8), g.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 8, 4096, 16), (80, 2, 3, 8), (3, 5, 1000, 7)],
                         ids=["tiny", "4096-tokens", "80-layers", "odd"])
def test_bit_exact_roundtrip(pair, dtype, shape):
    name, sender, receiver = pair
    kv = random_kv(*shape, dtype, seed=sum(shape))
    got, phases = roundtrip(sender, receiver, kv, f"{name}-{dtype}-{shape}")
    assert_bit_exact(kv, got)
    assert phases.bytes == layout_of(kv).total_nbytes and phases.total > 0
    if phases.bytes > 1 << 20:
        assert phases.wire > 0


def test_non_contiguous_sources(pair):
    name, sender, receiver = pair
    base = torch.randn(16, 9, 4).to(torch.bfloat16)
    k = base.permute(2, 1, 0)[:, :, ::2]
    assert not k.is_contiguous()
    got, _ = roundtrip(sender, receiver, [(k, k + 1)], f"{name}-strided")
    assert_bit_exact([(k, k + 1)], got)


def test_eight_transfers_in_flight(pair):
    name, sender, receiver = pair
    kvs = [random_kv(4, 2, 64 + i, 16, torch.float16, seed=i) for i in range(8)]
    errors = []

    def send(i):
        try:
            sender.send(receiver.address, f"{name}-c{i}", layout_of(kvs[i]), kvs[i])
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for i, kv in enumerate(kvs):
        got = receiver.wait(f"{name}-c{i}", 10)
        assert_bit_exact(kv, materialize(got, "cpu"))
        got.release()


def test_receiver_abort(pair):
    name, sender, receiver = pair
    kv = random_kv(2, 1, 4, 4, torch.float32)
    sender.send(receiver.address, f"{name}-ab", layout_of(kv), kv)
    receiver.abort(f"{name}-ab")
    with pytest.raises(TransferError, match="aborted"):
        receiver.wait(f"{name}-ab", 1)


def test_declared_size_over_limit_is_refused(pair):
    name, sender, receiver = pair
    layout = KVLayout(64, 8, 128, 4096, "float32")
    assert layout.total_nbytes > LIMIT
    small = torch.zeros(layout.tensor_shape[0], 1, layout.head_dim)

    def layers():
        yield small, small
    with pytest.raises(TransferError):
        sender.send(receiver.address, f"{name}-huge", layout, layers())
    kv = random_kv(1, 1, 2, 2, torch.float32)
    assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"{name}-after-huge")[0])


def test_kv_produced_in_sender_memory_moves_without_staging(pair):
    name, sender, receiver = pair
    kv = random_kv(6, 2, 37, 8, torch.bfloat16, seed=7)
    for whole in (False, True):
        placed, staged = send_placed(sender, receiver.address, f"{name}-placed-{whole}", kv, whole)
        assert placed == (name in OWNS_MEMORY)
        got = receiver.wait(f"{name}-placed-{whole}", 10)
        assert_bit_exact(kv, materialize(got, "cpu"))
        got.release()
        assert staged == 0
    if placed and not isinstance(sender, ProxySender):
        before = sender.staged_bytes
        assert_bit_exact(kv, roundtrip(sender, receiver, kv, f"{name}-staged")[0])
        assert sender.staged_bytes - before == layout_of(kv).total_nbytes

@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlx_array_sources_and_destinations(pair, dtype):
    """KV held as MLX arrays goes out as it is and lands as MLX arrays, bit-exact."""
    from kvtransfer.tensors import from_mlx, to_mlx

    name, sender, receiver = pair
    kv = random_kv(3, 2, 70, 8, dtype, seed=11)
    arrays = [(to_mlx(k), to_mlx(v)) for k, v in kv]
    sender.send(receiver.address, f"{name}-mlx-{dtype}", layout_of(kv), arrays)
    got = materialize(receiver.wait(f"{name}-mlx-{dtype}", 10), "mlx")
    assert type(got[0][0]).__module__.startswith("mlx")
    assert_bit_exact(kv, [(from_mlx(k), from_mlx(v)) for k, v in got])



def test_sender_killed_mid_transfer_fails_within_timeout(pair):
    """Last in the module: for mlx it breaks the fixed two-rank world."""
    name, sender, receiver = pair
    tid = f"{name}-killed"
    if name == "mlx":
        kv = random_kv(16, 4, 256, 128, torch.float16)
        sender.send(receiver.address, tid, layout_of(kv), kv, die_after=8)
        assert sender.world.child.wait(30) == -9
    else:
        child = subprocess.run([sys.executable, "-m", "tests.sender_child", name, receiver.address, tid], timeout=60)
        assert child.returncode == -9
    start = time.monotonic()
    with pytest.raises((TransferError, TimeoutError)):
        receiver.wait(tid, receiver.cfg.timeout_s)
    assert time.monotonic() - start < receiver.cfg.timeout_s + 1

