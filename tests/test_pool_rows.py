"""KV where a paged pool holds it (``PoolRows``): the same pieces as a list of views, copies into and out of a
canonical buffer by index equal to the ``cat`` path for every dtype, and the block manager hands out blocks so that
sequences keep few runs after the prefix cache has filled the pool."""
import pytest
import torch

from engine.blocks import BlockManager
from engine.kv_pool import KVPool, _consecutive
from kvtransfer import PiecewiseKV, PoolRows
from kvtransfer.transports.nccl.ops import gather, scatter
from kvtransfer.pieces import piece_tokens
from kvtransfer.tensors import layout_of

TABLE = [5, 6, 7, 2, 9, 10, 0]  # 4-token blocks: runs 5-7, 2, 9-10, 0
TOKENS = 26

DTYPES = [torch.float32, torch.bfloat16]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def filled_pool(dtype, seed=0):
    pool = KVPool(3, 12, 4, 2, 8, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for k, v in pool.layers:
        for t in (k, v):
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return pool


def as_bytes(layers):
    return [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in layers]


def test_rows_index_like_the_list_of_views_and_slice_by_layer():
    pool = filled_pool(torch.float32)
    rows, views = PoolRows(*_rows(pool)), pool.pieces(TABLE, TOKENS)
    assert len(rows) == 3 and rows.tokens == TOKENS
    assert rows.piece_tokens() == [p.shape[0] for p in views[0][0]] == [12, 4, 8, 2]
    for (ks, vs), (kl, vl) in zip(rows, views):
        assert all(torch.equal(a, b) for a, b in zip(ks + vs, kl + vl))
    tail = rows[1:]
    assert isinstance(tail, PoolRows) and len(tail) == 2 and torch.equal(tail[0][0][0], views[1][0][0])
    flat = torch.cat([pool.flat[0][0][s:e] for s, e in rows.spans])
    assert torch.equal(pool.flat[0][0][rows.slots("cpu")], flat)


def _rows(pool):
    return pool.flat, pool.spans(TABLE, TOKENS)


@pytest.mark.parametrize("index_above", [0, 8], ids=["by-index", "by-views"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_scatter_by_index_equal_the_cat_path(dtype, index_above):
    src = filled_pool(dtype)
    kv_list = PiecewiseKV(layout_of(src.gather(TABLE, TOKENS)), src.pieces(TABLE, TOKENS)).check()
    kv_rows = PiecewiseKV(kv_list.layout, PoolRows(*_rows(src), index_above)).check()  # 4 spans
    assert piece_tokens(kv_rows) == piece_tokens(kv_list)
    nbytes = kv_list.layout.total_nbytes
    by_cat, by_index = torch.zeros(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    gather(kv_list.layers, by_cat, kv_list.layout)
    gather(kv_rows.layers, by_index, kv_rows.layout)
    assert torch.equal(by_cat, by_index)

    dst = KVPool(3, 12, 4, 2, 8, dtype, "cpu")
    table = [11, 3, 4, 8, 1, 6, 7]
    scatter(by_index, PoolRows(dst.flat, dst.spans(table, TOKENS), index_above), kv_rows.layout)
    for (k0, v0), (k1, v1) in zip(as_bytes(src.gather(TABLE, TOKENS)), as_bytes(dst.gather(table, TOKENS))):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    untouched = [b for b in range(12) if b not in table]
    assert all(int(k.view(torch.uint8)[untouched].count_nonzero()) == 0 for k, _ in dst.layers)


def test_rows_that_do_not_fit_the_layout_are_refused():
    pool = filled_pool(torch.float32)
    layout = layout_of(pool.gather(TABLE, TOKENS))
    with pytest.raises(ValueError, match="tokens"):
        PiecewiseKV(layout, PoolRows(pool.flat, pool.spans(TABLE, TOKENS - 1))).check()
    with pytest.raises(ValueError, match="outside"):
        PiecewiseKV(layout, PoolRows(pool.flat, [(40, 66)])).check()
    other = filled_pool(torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        PiecewiseKV(layout, PoolRows(other.flat, other.spans(TABLE, TOKENS))).check()


def runs(table):
    return 1 + sum(1 for a, b in zip(table, table[1:]) if b != a + 1)


def test_blocks_evicted_from_the_prefix_cache_come_back_as_runs():
    """Once every block has been cached, a new sequence's blocks are evicted ones: those two sequences let go
    together, which, handed out in ascending order, are their runs again (in eviction order: a run per block)."""
    blocks = BlockManager(100, 16, caching=True)
    a, b = [], []
    blocks.grow(a, 40 * 16)
    blocks.grow(b, 40 * 16)
    for i, block in enumerate(a + b):
        blocks.register(block, 1000 + i)
    blocks.release(a)
    blocks.release(b)
    c = []
    blocks.grow(c, 60 * 16)  # 20 never used, then the 40 least recently cached
    assert c == sorted(c) and runs(c) == 2
    d = []
    blocks.grow(d, 40 * 16)
    assert runs(d) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_gather_equals_each_layers_rows_into_any_memory(dtype, heads):
    """One copy of every layer into memory laid out back to back (a transport's own), a copy a tensor into any
    other, and fresh tensors: each the rows of each layer's blocks, in order."""
    pool = filled_pool(dtype)
    h0, h1 = heads or (0, 2)
    slots = [b * 4 + i for b in TABLE for i in range(4)][:TOKENS]
    want = [(k.view(-1, 2, 8)[slots, h0:h1], v.view(-1, 2, 8)[slots, h0:h1]) for k, v in pool.layers]
    region = torch.zeros(6 * TOKENS * (h1 - h0) * 8, dtype=dtype).view(6, TOKENS, h1 - h0, 8)
    back_to_back = list(zip(region[0::2], region[1::2]))
    apart = [(torch.zeros(TOKENS, h1 - h0, 8, dtype=dtype), torch.zeros(TOKENS, h1 - h0, 8, dtype=dtype))
             for _ in range(3)]
    shape = (6, TOKENS, h1 - h0, 8)
    assert _consecutive(back_to_back, shape, dtype) is not None and _consecutive(apart, shape, dtype) is None
    for into in (back_to_back, apart, None):
        got = pool.gather(TABLE, TOKENS, into, heads)
        if into is not None:
            assert all(g[0] is i[0] and g[1] is i[1] for g, i in zip(got, into))
        pairs = zip(as_bytes(got), as_bytes(want), strict=True)
        assert all(torch.equal(a, b) for p, q in pairs for a, b in zip(p, q))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gather_on_a_stream_of_its_own_waits_for_no_step_queued_on_the_engines():
    """A move's pause copies the KV out beside the step in flight: neither the host nor the copy waits for it."""
    pool = KVPool(3, 12, 4, 2, 8, torch.bfloat16, "cuda")
    for k, v in pool.layers:
        k.normal_(), v.normal_()
    slots = [b * 4 + i for b in TABLE for i in range(4)][:TOKENS]
    want = [(k.view(-1, 2, 8)[slots], v.view(-1, 2, 8)[slots]) for k, v in pool.layers]
    torch.cuda.synchronize()
    torch.cuda._sleep(3_000_000_000)  # a long step queued on the engine's stream (about a second)
    step = torch.cuda.Event()
    step.record()
    with torch.cuda.stream(torch.cuda.Stream()):
        got = pool.gather(TABLE, TOKENS)
        copied = torch.cuda.Event()
        copied.record()
    assert not step.query(), "the gather waited for the queued step on the host"
    copied.synchronize()
    assert not step.query(), "the copy ran behind the queued step"
    assert all(torch.equal(a, b) for p, q in zip(got, want) for a, b in zip(p, q))
