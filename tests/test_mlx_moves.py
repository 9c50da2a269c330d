"""A decoding sequence moved off the MLX engine (``set_aside``, ``kv_out``, ``take_back``, as ``decode.migrate``
drives them): set aside mid-way, its KV (every token but the last) goes on in a second engine, MLX or torch, to the
tokens of the undisturbed run; taken back instead, it goes on where it stood; the batch around it is undisturbed.
Through ``pdserve up`` with MLX decode workers, ``tests/test_migration.py`` drains one."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generate import generate_many  # noqa: E402
from engine.requests import resumed_sequence  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

TOKENS = 300
PARAMS = dict(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [list(range(5, 40)), list(range(60, 71)), list(range(100, 150))]


def mlx_engine():
    from engine.mlx.engine import MlxEngine

    return MlxEngine(EngineConfig(model="tiny-llama", threads=1))


def started(engine, steps: int) -> list[Sequence]:
    seqs = [Sequence.create(f"s{i}", p, SamplingParams(**PARAMS), engine.tokenizer, engine.max_len)
            for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    while min(len(s.output_ids) for s in seqs) < steps:
        engine.step()
    return seqs


def finish(engine, seqs) -> None:
    while not all(s.finished for s in seqs):
        engine.step()


@pytest.fixture(scope="module")
def whole():
    engine = mlx_engine()
    return [s.output_ids for _, s in generate_many(engine, PROMPTS, [SamplingParams(**PARAMS)] * len(PROMPTS))]


@pytest.mark.parametrize("into", ["mlx", "torch"])
def test_a_sequence_set_aside_goes_on_in_another_engine_from_its_kv(whole, into):
    source = mlx_engine()
    seqs = started(source, 9)
    moving = seqs[1]
    source.set_aside(moving)
    assert moving not in source.running
    tokens = moving.num_tokens - 1
    kv = source.kv_out(moving, 0, tokens)
    assert len(kv) == source.kv_shape[0] and kv[0][0].shape == (tokens, *source.kv_shape[1:])
    target = mlx_engine() if into == "mlx" else Engine(EngineConfig(model="tiny-llama", threads=1))
    seq = resumed_sequence(target, "moved", moving.prompt_ids, moving.output_ids[-1], moving.detok.emitted,
                           moving.params.to_dict(), moving.output_ids[:-1])
    if into == "torch":
        from kvtransfer.tensors import from_mlx

        kv = [tuple(from_mlx(a) for a in pair) for pair in kv]
    assert target.add_prefilled(seq, kv)
    assert seq.num_computed == tokens
    finish(target, [seq])
    assert seq.output_ids == whole[1]
    source.free(moving)
    finish(source, [seqs[0], seqs[2]])  # the rows that stayed decode on undisturbed
    assert [seqs[0].output_ids, seqs[2].output_ids] == [whole[0], whole[2]]


def test_a_sequence_taken_back_goes_on_where_it_stood(whole):
    engine = mlx_engine()
    seqs = started(engine, 7)
    engine.set_aside(seqs[0])
    had = len(seqs[0].output_ids)
    engine.step()  # the others decode one step without it
    assert len(seqs[0].output_ids) == had
    engine.take_back(seqs[0])
    finish(engine, seqs)
    assert [s.output_ids for s in seqs] == whole
    assert not engine.caches and not engine.running


def test_a_stream_drained_off_an_mlx_decode_worker_ends_as_undisturbed(tmp_path):
    """``pdserve up`` with two MLX decode workers (prefill on torch): the one decoding a stream drained mid-way, the
    stream moves over tcp to the other (everything at the pause: an MLX target has no blocks to hold KV sent ahead)
    and ends with every token and the undisturbed run's text; the drained worker then holds nothing. (One stream:
    MLX's CPU backend keeps a core busy a decoding worker, and with both cores so taken the client here stalls.)"""
    from deploy.local import Cluster
    from tests.checkpoints import SLOW, write_checkpoint
    from tests.moves import check_drained, decode_workers, drain_busiest, moved, run_streams

    model = write_checkpoint(tmp_path, SLOW)
    c = Cluster("--decode", "2", "--model", model, "--decode-engine", "mlx").wait_ready()
    try:
        bodies = [{"model": model.rsplit("/", 1)[1], "max_tokens": TOKENS, "temperature": 0,
                   "extra_body": {"ignore_eos": True}, "prompt": "one stream: the quick brown fox"}]
        want, _ = run_streams(c.url, bodies)
        decoding = lambda: sum(w["outstanding"] for w in decode_workers(c.url)) == 1  # noqa: E731
        got, address = run_streams(c.url, bodies, drain_busiest, decoding)
        assert [s.texts for s in got] == [s.texts for s in want]
        assert [s.tokens for s in got] == [{0: TOKENS}]
        assert moved(c.url) == 1
        check_drained(c.url, address)
    finally:
        c.stop()
