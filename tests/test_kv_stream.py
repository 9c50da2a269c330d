"""Layer-wise KV streaming: a sender moves each layer as the (here simulated, in the e2e test real) prefill forward
writes it; bytes of early layers land before later layers exist; a forward that fails mid-way fails the transfer
and frees the receiver's blocks; ``pdserve up`` streams by default and answers exactly as without streaming."""
import importlib.util
import threading
import time

import httpx
import pytest
import torch

from deploy.local import Cluster
from engine.progress import LayerProgress, StepFailed
from kvtransfer import KVLayout, Landing, PiecewiseKV, TransferError, TransportConfig, make_receiver, make_sender
from kvtransfer.tensors import materialize
from tests.checkpoints import SLOW, write_checkpoint
from tests.test_failures import eventually
from tests.test_pieces import expected, pieces_of, pool



def test_layer_progress_orders_fails_and_ends():
    p = LayerProgress(3, "cpu")
    p.layer_done(0)
    assert p.wait(0, 1) is None
    with pytest.raises(StepFailed):
        p.wait(1, 0.05)
    with pytest.raises(RuntimeError):
        p.layer_done(2)
    p.layer_done(1)
    p.fail(ValueError("boom"))
    assert p.wait(1, 1) is None
    with pytest.raises(StepFailed, match="boom"):
        p.wait(2, 1)
    q = LayerProgress(2, "cpu")
    q.layer_done(0)
    q.finish()
    with pytest.raises(StepFailed, match="never reported"):
        q.wait(1, 1)
    assert q.wait_computed(1) == q.computed_at


def pair(name):
    opts = {"shm_bytes": 16 << 20}
    receiver = make_receiver(name, TransportConfig(timeout_s=5.0, options=opts))
    receiver.start()
    return make_sender(name, TransportConfig(timeout_s=5.0, options=opts)), receiver


STREAMING = ["tcp", "shm", pytest.param("arrow", marks=pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed"))]


@pytest.mark.parametrize("name", STREAMING)
def test_early_layers_land_while_later_ones_are_computed(name):
    """tcp lands each layer in the blocks as it arrives (shm without a shared pool into its own segment: there only
    the result is checked)."""
    layout = KVLayout(4, 2, 8, 40, "bfloat16")
    source, target = pool(layout, 8, seed=1), pool(layout, 8, seed=2)
    for k, v in target:
        k.zero_()
        v.zero_()
    src_table, dst_table = [2, 3, 7], [5, 0, 1]
    sender, receiver = pair(name)
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(target, dst_table, lay.num_tokens)), lambda: None)
    progress = LayerProgress(layout.num_layers, "cpu", timeout_s=10)
    kv = PiecewiseKV(layout, pieces_of(source, src_table, layout.num_tokens), gate=progress)
    try:
        done = threading.Thread(target=sender.send, args=(receiver.address, "s", layout, kv), daemon=True)
        done.start()
        progress.layer_done(0)
        progress.layer_done(1)
        want = expected(source, src_table, layout.num_tokens)

        def landed(i):
            got = expected(target, dst_table, layout.num_tokens)[i]
            return torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
        if name in ("tcp", "arrow"):
            assert eventually(lambda: landed(0) and landed(1), 5), "layers 0-1 should land before 2-3 exist"
            assert not landed(3)
        progress.layer_done(2)
        progress.layer_done(3)
        progress.finish()
        done.join(10)
        got = receiver.wait("s", 5)
        if got.landed is None:  # shm without a shared pool: in the receiver's segment
            assert all(torch.equal(a, b) for g, w in zip(materialize(got, "cpu"), want) for a, b in zip(g, w))
        else:
            assert all(landed(i) for i in range(layout.num_layers))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("name", STREAMING)
def test_a_forward_that_fails_mid_stream_fails_the_transfer_and_frees_the_landing(name):
    layout = KVLayout(4, 2, 8, 20, "float32")
    source, target = pool(layout, 4, seed=3), pool(layout, 4, seed=4)
    sender, receiver = pair(name)
    released = threading.Event()
    receiver.land = lambda tid, lay: Landing(PiecewiseKV(lay, pieces_of(target, [0, 1], lay.num_tokens)), released.set)
    progress = LayerProgress(layout.num_layers, "cpu", timeout_s=10)
    kv = PiecewiseKV(layout, pieces_of(source, [2, 3], layout.num_tokens), gate=progress)
    errors = []

    def send():
        try:
            sender.send(receiver.address, "f", layout, kv)
        except (TransferError, StepFailed) as e:
            errors.append(e)
    try:
        t = threading.Thread(target=send, daemon=True)
        t.start()
        progress.layer_done(0)
        time.sleep(0.1)
        progress.fail(RuntimeError("out of memory in layer 1"))
        t.join(10)
        assert errors and "layer 1" in str(errors[0])
        if name in ("tcp", "arrow"):  # shm lands in blocks only when they are in its shared memory (as in a decode worker)
            assert released.wait(5)
        with pytest.raises(TransferError):
            receiver.wait("f", 5)
        # the receiver keeps serving
        sender.send(receiver.address, "g", layout, PiecewiseKV(layout, pieces_of(source, [2, 3], layout.num_tokens)))
        receiver.wait("g", 5).release()
    finally:
        sender.close()
        receiver.close()


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("slow"), SLOW)


STREAMED_PROMPTS = ["The quick brown fox " * 60, "hi", "tokens " * 200]


def answers_of(model_dir: str, *args: str) -> list[dict]:
    cluster = Cluster("--model", model_dir, *args).wait_ready()
    try:
        return [httpx.post(cluster.url + "/v1/completions", timeout=120, json={
            "model": model_dir.rsplit("/", 1)[1], "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json() for p in STREAMED_PROMPTS]
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def colocated_answers(slow_model):
    return answers_of(slow_model, "--colocated")


@pytest.mark.parametrize("transport", STREAMING)
def test_up_streams_kv_and_answers_exactly_as_without_streaming(slow_model, colocated_answers, transport):
    """Streamed on every transport; off (``--no-kv-stream``) on tcp only: the KV sent whole after the forward is what
    the conformance tests move on every transport."""
    answers = {"stream": answers_of(slow_model, "--transport", transport), "colocated": colocated_answers}
    if transport == "tcp":
        answers["off"] = answers_of(slow_model, "--transport", transport, "--no-kv-stream")
    for mode in answers.keys() - {"colocated"}:
        for got, want in zip(answers[mode], answers["colocated"]):
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
            timing = got["pdserve"]
            assert timing["streamed"] is (mode == "stream")
            assert timing["overlap"] >= 0 and timing["exposed"] >= 0
    assert answers["stream"][0]["pdserve"]["overlap"] > 0
    assert "off" not in answers or answers["off"][0]["pdserve"]["overlap"] == 0
