"""The paged engine against Hugging Face transformers, for tiny random checkpoints of every supported family
(fp32): greedy tokens equal and logprobs within 1e-4, alone and batched, joining mid-run, in chunks, preempted."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.generate import generate_many
from engine.sequence import Sequence
from tests.checkpoints import write_tokenizer
from tests.hf_reference import hf_greedy, hf_model

BASE = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
}
GREEDY = dict(temperature=0, ignore_eos=True, logprobs=0)


def write_family(path, family: str, overrides: dict | None = None) -> str:
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, **(overrides or {})})
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return write_tokenizer(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = write_family(tmp_path_factory.mktemp(request.param), request.param)
    return path, hf_model(path)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check(seqs, hf, max_tokens):
    for seq in seqs:
        want_ids, want_lp = hf_greedy(hf, seq.prompt_ids, max_tokens or seq.params.max_tokens)
        assert seq.output_ids == want_ids
        got_lp = [e[1] for e in seq.pending_logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)


def staggered(engine, ps, max_tokens):
    """One new sequence joins per step until all finish: ``(sequences, step outputs)``."""
    seqs = [Sequence.create(f"s{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY), engine.tokenizer,
                            engine.max_len) for i, p in enumerate(ps)]
    outs = []
    while not all(s.finished for s in seqs):
        if len(outs) < len(seqs):
            engine.add(seqs[len(outs)])
        outs.append(engine.step())
    return seqs, outs


def engine_for(path, **kw):
    return Engine(EngineConfig(model=path, threads=1, block_size=kw.pop("block_size", 8), **kw))


def test_one_and_eight_batched_match_hf(family):
    path, hf = family
    engine = engine_for(path)
    ps = prompts(8)
    one = generate_many(engine, ps[:1], [SamplingParams(max_tokens=12, **GREEDY)])
    many = generate_many(engine, ps, [SamplingParams(max_tokens=12, **GREEDY)] * 8)
    check([s for _, s in one + many], hf, 12)
    assert engine.blocks.num_free == engine.num_blocks


def test_grouped_matmul_decode_matches_hf(family, monkeypatch):
    """The decode kernel CUDA uses, run on the CPU."""
    import engine.attention

    monkeypatch.setattr(engine.attention, "FORCE_DECODE", "matmul")
    path, hf = family
    engine_ = engine_for(path)
    check([s for _, s in generate_many(engine_, prompts(4, seed=3), [SamplingParams(max_tokens=8, **GREEDY)] * 4)], hf, 8)


def test_fixed_shape_decode_matches_hf(family):
    """The padded, fixed-shape decode step that CUDA graphs capture (torch operations, run eagerly here), with the
    batch growing and shrinking across the captured sizes."""
    path, hf = family
    engine = engine_for(path, decode_graphs="eager", max_num_seqs=24)
    assert engine.runner.graphs.sizes == [1, 2, 4, 8, 16, 32]
    ps = prompts(7, seed=4)
    seqs = [Sequence.create(f"g{i}", p, SamplingParams(max_tokens=6 + 3 * i, **GREEDY), engine.tokenizer, engine.max_len)
            for i, p in enumerate(ps)]
    step = 0
    while not all(s.finished for s in seqs):
        if step < len(seqs):
            engine.add(seqs[step])
        engine.step()
        step += 1
    check(seqs, hf, None)
    assert engine.runner.graphs.runs > 10
    assert engine.blocks.num_free == engine.num_blocks


def test_joining_mid_run_and_chunked_prefill_match_hf(family):
    path, hf = family
    engine = engine_for(path, max_batched_tokens=16)
    seqs, outs = staggered(engine, prompts(5, seed=1), 10)
    assert all(out.batch_tokens <= 16 and not out.refused for out in outs)
    check(seqs, hf, 10)
    assert engine.blocks.num_free == engine.num_blocks


def test_preemption_recomputes_and_matches_hf(family):
    path, hf = family
    engine = engine_for(path, num_blocks=14, block_size=4)
    ps = prompts(4, seed=2)
    params = [SamplingParams(max_tokens=12, **GREEDY)] * 4
    done = generate_many(engine, [p[:12] for p in ps], params)
    assert engine.scheduler.preemptions > 0
    check([s for _, s in done], hf, 12)
    assert engine.blocks.num_free == engine.num_blocks


def test_seeded_sampling_is_the_same_alone_and_batched():
    engine = Engine(EngineConfig(threads=1))
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=i, ignore_eos=True,
                             frequency_penalty=0.5) for i in range(4)]
    texts = ["Hello", "Once upon a time", "x" * 40, "abc"]
    batched = generate_many(engine, texts, params)
    for (text, seq), prompt, p in zip(batched, texts, params):
        alone = generate_many(engine, [prompt], [p])[0][1]
        assert alone.output_ids == seq.output_ids


def test_every_block_is_free_after_finish_abort_failure_and_preemption():
    engine = Engine(EngineConfig(threads=1, num_blocks=12, block_size=4))
    seqs = [Sequence.create(f"s{i}", "ab" * (4 + i), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            engine.tokenizer, engine.max_len) for i in range(5)]
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            engine.free(seqs[1])
        if steps == 5:
            engine.free(seqs[4])
    assert engine.scheduler.preemptions > 0
    assert engine.blocks.num_free == engine.num_blocks and all(r == 0 for r in engine.blocks.refs)
    huge = Sequence.create("huge", "z" * 60, SamplingParams(max_tokens=4), engine.tokenizer, engine.max_len)
    engine.add(huge)
    assert engine.step().refused == [huge]
    assert engine.blocks.num_free == engine.num_blocks


def test_unsupported_architecture_names_the_supported_ones():
    from types import SimpleNamespace

    from engine.models import build

    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        build(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
