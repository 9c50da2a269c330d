"""The engine's prefix cache: outputs identical with it on and off (shared prefixes of no, part of a, one exact
and many blocks, after eviction, preempted), and a repeated prefix computed only once."""
import pytest

from engine import EngineConfig, SamplingParams
from engine.blocks import BlockManager
from engine.engine import Engine
from engine.generate import generate_many
from engine.prefix_hash import block_hashes
from tests.test_paged_engine import BASE, GREEDY, write_family

BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setitem(BASE, "max_position_embeddings", 2048)
    return write_family(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def engine(path, caching, **kw):
    return Engine(EngineConfig(model=path, threads=1, block_size=BLOCK, prefix_caching=caching, **kw))


def run(eng, prompts, max_tokens=8):
    """Prompts one after another (each may reuse what the ones before left), then all together."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    alone = [generate_many(eng, [p], [params])[0][1] for p in prompts]
    together = [s for _, s in generate_many(eng, prompts, [params] * len(prompts))]
    return [(s.output_ids, [round(e[1], 4) for e in s.pending_logprobs]) for s in alone + together]


def base(n, seed=0):
    return [3 + (seed * 31 + i * 7) % 250 for i in range(n)]


@pytest.mark.parametrize("shared", [0, 5, BLOCK, 4 * BLOCK, 4 * BLOCK + 3], ids=["none", "part", "one-exact",
                                                                                "many-exact", "many-part"])
def test_outputs_are_identical_with_and_without_the_cache(model, shared):
    prefix = base(shared)
    prompts = [prefix + base(6, seed=1), prefix + base(11, seed=2), prefix, prefix + base(1, seed=3)]
    prompts = [p for p in prompts if p]
    on, off = engine(model, True), engine(model, False)
    assert run(on, prompts) == run(off, prompts)
    assert on.blocks.num_free == on.num_blocks and off.blocks.num_cached == 0
    if shared >= BLOCK:
        assert on.cached_tokens > 0 and on.prefix_hits > 0


def test_a_prompt_cached_in_full_copies_its_last_block_and_computes_one_token(model):
    eng = engine(model, True)
    prompt = base(3 * BLOCK)
    first = run(eng, [prompt])
    assert eng.cached_tokens == 3 * BLOCK - 1  # the second run (batched): all but the last token
    assert first == run(engine(model, False), [prompt])


def test_eviction_keeps_outputs_identical(model):
    small = dict(num_blocks=12)
    prompts = [base(40, seed=i) for i in range(4)] + [base(40, seed=0)]
    on, off = engine(model, True, **small), engine(model, False, **small)
    assert run(on, prompts, 4) == run(off, prompts, 4)
    stored, evicted = on.blocks.drain_events()
    assert evicted and stored


def test_preempted_sequences_reuse_their_own_blocks_and_match(model):
    tight = dict(num_blocks=14, block_size=4)
    on = Engine(EngineConfig(model=model, threads=1, prefix_caching=True, **tight))
    off = Engine(EngineConfig(model=model, threads=1, prefix_caching=False, **tight))
    prompts = [base(12, seed=i) for i in range(4)]
    params = [SamplingParams(max_tokens=12, **GREEDY)] * 4
    got = [s.output_ids for _, s in generate_many(on, prompts, params)]
    assert got == [s.output_ids for _, s in generate_many(off, prompts, params)]
    assert on.scheduler.preemptions > 0


def test_a_second_request_with_the_same_1000_token_prefix_computes_only_its_suffix(model):
    eng = engine(model, True, max_model_len=1100)
    prefix = base(1000)
    run(eng, [prefix + base(20, seed=1)], 2)
    before = eng.cached_tokens
    params = SamplingParams(max_tokens=2, **GREEDY)
    seq = generate_many(eng, [prefix + base(30, seed=2)], [params])[0][1]
    assert seq.cached_tokens == 1000 // BLOCK * BLOCK and eng.cached_tokens - before == seq.cached_tokens


def test_block_manager_hands_out_free_blocks_before_evicting_cached_ones():
    bm = BlockManager(4, 2, caching=True)
    keys = block_hashes([5, 6, 7, 8], 2, "m")
    table = []
    bm.grow(table, 4)
    for block, key in zip(table, keys):
        bm.register(block, key)
    bm.release(table)
    assert bm.num_free == 4 and bm.num_cached == 2
    other = []
    bm.grow(other, 4)  # two truly free blocks first
    assert bm.num_cached == 2 and bm.match(keys) == [0, 1]
    more = []
    bm.grow(more, 2)  # then a cached block: the sequence's last one, so its first still matches
    assert bm.match(keys) == [0] and bm.drain_events() == ([keys[0]], [keys[1]])
    bm.grow(more, 4)
    assert bm.match(keys) == []


def test_under_pressure_every_cached_prompt_keeps_its_head_matchable():
    """Two prompts of four blocks cached, then two blocks taken: the older prompt's last two go, it keeps half its
    hit (evicted head first, it would keep none and its other blocks would sit unmatchable)."""
    bm = BlockManager(8, 2, caching=True)
    prompts = [block_hashes(list(range(s, s + 8)), 2, "m") for s in (10, 50)]
    for keys in prompts:
        table = []
        bm.grow(table, 8)
        for block, key in zip(table, keys):
            bm.register(block, key)
        bm.release(table)
    taken = []
    bm.grow(taken, 4)
    assert [len(bm.match(keys)) for keys in prompts] == [2, 4]
