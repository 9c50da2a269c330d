"""The MLX engine (mlx-lm's models; ``mlx[cpu]`` on Linux) against the torch engine: greedy tokens equal for tiny
random Llama and Qwen3 checkpoints (fp32) and the built-in model, one sequence and eight batched, joining mid-run;
KV out of one engine continues in the other (heterogeneous pairs), including bf16 into fp32."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generate import generate_many  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from kvtransfer.tensors import from_mlx  # noqa: E402
from tests.test_paged_engine import GREEDY, prompts, staggered, write_family  # noqa: E402


def mlx_engine(model, **kw):
    from engine.mlx.engine import MlxEngine

    engine_kw = kw.pop("engine_kw", {})
    return MlxEngine(EngineConfig(model=model, threads=1, **kw), **engine_kw)


@pytest.fixture(scope="module", params=["llama", "qwen3", "tiny-llama", "mixtral", "qwen3-moe"])
def model(request, tmp_path_factory):
    if request.param == "tiny-llama":
        return "tiny-llama"
    return write_family(tmp_path_factory.mktemp(request.param), request.param)


def outputs(engine, ps, max_tokens=10):
    return [s.output_ids for _, s in generate_many(engine, ps, [SamplingParams(max_tokens=max_tokens, **GREEDY)] * len(ps))]


def test_greedy_tokens_equal_the_torch_engine_alone_and_batched(model):
    torch_engine, mlx = Engine(EngineConfig(model=model, threads=1)), mlx_engine(model)
    ps = prompts(8, seed=5)
    for batch in (ps[:1], ps):
        assert outputs(mlx, batch) == outputs(torch_engine, batch)


def test_sequences_joining_mid_run_and_long_prompts_in_chunks(model):
    torch_engine, mlx = Engine(EngineConfig(model=model, threads=1)), mlx_engine(model, max_batched_tokens=16)
    ps = prompts(5, seed=6)
    seqs, _ = staggered(mlx, ps, 8)
    assert [s.output_ids for s in seqs] == outputs(torch_engine, ps, 8)
    assert not mlx.running and all(b.caches is None for b in mlx.micro.batches)


@pytest.mark.parametrize("prefill_kind,decode_kind", [("mlx", "torch"), ("torch", "mlx")])
def test_kv_from_one_engine_continues_in_the_other(model, prefill_kind, decode_kind):
    """What a heterogeneous pair does, in one process: prefill's first token and canonical KV, decode's rest."""
    make = {"torch": lambda **kw: Engine(EngineConfig(model=model, threads=1), **kw),
            "mlx": lambda **kw: mlx_engine(model, engine_kw=kw)}
    prefill, decode = make[prefill_kind](hold_after_first=True), make[decode_kind]()
    reference = Engine(EngineConfig(model=model, threads=1))
    ps = prompts(3, seed=7)
    want = outputs(reference, ps, 8)
    for prompt, expected in zip(ps, want):
        params = SamplingParams(max_tokens=8, **GREEDY)
        seq = Sequence.create("p", prompt, params, prefill.tokenizer, prefill.max_len)
        prefill.add(seq)
        while not seq.output_ids:
            prefill.step()
        kv = prefill.gather_prompt(seq) if prefill_kind == "mlx" else prefill.gather(seq)
        if prefill_kind == "mlx":
            kv = [(from_mlx(k), from_mlx(v)) for k, v in kv]
        prefill.free(seq)
        cont = Sequence.resume("d", seq.prompt_ids, seq.output_ids[0], seq.detok.emitted, params, decode.tokenizer,
                               decode.max_len)
        assert decode.add_prefilled(cont, [(k.clone(), v.clone()) for k, v in kv])
        while not cont.finished:
            decode.step()
        assert cont.output_ids == expected


def test_bf16_kv_lands_in_an_fp32_mlx_engine_converted():
    torch_engine = Engine(EngineConfig(threads=1, dtype="bfloat16"), hold_after_first=True)
    mlx = mlx_engine("tiny-llama")
    seq = Sequence.create("p", "Hello there", SamplingParams(max_tokens=4, **GREEDY), torch_engine.tokenizer, 1024)
    torch_engine.add(seq)
    while not seq.output_ids:
        torch_engine.step()
    kv = torch_engine.gather(seq)
    assert kv[0][0].dtype == torch.bfloat16
    cont = Sequence.resume("d", seq.prompt_ids, seq.output_ids[0], seq.detok.emitted, seq.params, mlx.tokenizer, 1024)
    mlx.add_prefilled(cont, kv)
    assert mlx.micro.batches[0].caches[0].keys.dtype == mlx.mx.float32
    while not cont.finished:
        mlx.step()
    assert len(cont.output_ids) == 4


def test_a_4bit_mlx_checkpoint_loads_and_decodes_batched_as_alone(tmp_path):
    """An MLX-converted, 4-bit quantized checkpoint (``mlx_lm.convert``): it runs, and batching does not change it."""
    from mlx_lm.convert import convert

    src = write_family(tmp_path / "src", "llama")
    convert(hf_path=src, mlx_path=str(tmp_path / "q4"), quantize=True, q_group_size=32, q_bits=4)
    engine = mlx_engine(str(tmp_path / "q4"))
    assert "QuantizedLinear" in type(engine.model.layers[0].self_attn.q_proj).__name__
    ps = prompts(4, seed=9)
    alone = [outputs(engine, [p])[0] for p in ps]
    assert outputs(engine, ps) == alone and all(len(o) == 10 for o in alone)


def test_a_json_schema_holds_on_the_mlx_engine_as_on_the_torch_engine(model):
    import json

    from engine.requests import new_sequence

    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 0, "maximum": 50}}}
    texts = []
    for engine in (mlx_engine(model), Engine(EngineConfig(model=model, threads=1, warmup=False))):
        seq = new_sequence(engine, "g", {"prompt": "JSON:", "params": {"max_tokens": 40, "temperature": 0,
                                                                          "guide": {"kind": "json_schema",
                                                                                    "value": schema}}})
        engine.add(seq)
        while engine.has_work:
            engine.step()
        texts.append(engine.tokenizer.decode(seq.output_ids))
        assert set(json.loads(texts[-1])) == {"a", "b"}
    assert texts[0] == texts[1]
