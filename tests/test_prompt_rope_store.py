"""Prompt chunks rotated and stored in one launch (``Attention.prompt_ops``: ``rope_store`` with ``keep``, what
CUDA engines run through ``triton_attention``), here through its torch form: the same tokens and logprobs, bit
for bit, as the separate rotary and K/V store, for fresh prompts, chunked ones, cached prefixes and steps that mix
prompt chunks with decodes, on a GQA model and on one with a sliding window."""
import types

import pytest

from engine import SamplingParams
from engine.generate import generate_many
from engine.kernels import paged
from tests.test_paged_engine import GREEDY, engine_for, write_family


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else None
    return write_family(tmp_path_factory.mktemp(request.param), request.param, overrides)


def _outputs(path, fused: bool, calls: list) -> list:
    engine = engine_for(path, max_batched_tokens=24, prefix_caching=True, device="cpu")  # the torch form: CPU
    counted = types.SimpleNamespace(rope_store=lambda *a, **kw: calls.append(len(a[0])) or paged.rope_store(*a, **kw))
    if fused:
        for layer in engine.model.owned_layers:
            layer.self_attn.prompt_ops = counted
    shared = list(range(5, 45))
    prompts = [shared + [50, 51], list(range(60, 75)), shared + [52, 53, 54], [7, 8, 9]]
    first = generate_many(engine, prompts[:2], [SamplingParams(max_tokens=6, **GREEDY)] * 2)
    later = generate_many(engine, prompts, [SamplingParams(max_tokens=9, **GREEDY)] * 4)  # cached prefixes, mixed
    assert engine.cached_tokens > 0
    return [(s.output_ids, [e[1] for e in s.pending_logprobs]) for _, s in first + later]


def test_prompt_chunks_through_rope_store_match_the_separate_launches(model):
    calls = []
    assert _outputs(model, True, calls) == _outputs(model, False, [])
    assert calls and max(calls) > 1  # prompt chunks went through it
