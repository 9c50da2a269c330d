"""``kernels.triton_mixed``: decode rows and prompt chunks (fresh, after a cached prefix, longer than a tile) of one
step attended in one launch over the paged pool equal each sequence's causal attention over its gathered context
(within a sliding window; GQA groups of 1, 4 and 8; an FP8 pool with scales; rows no tile names untouched; long
key ranges split and merged); and the kernels build for Hopper."""
import pytest
import torch
import torch.nn.functional as F

from tests.triton_env import DEVICE, compile_for_hopper, needs_triton  # first: the interpreter where there is no GPU
from engine.kernels import triton_mixed
from engine.quant import kv_fp8

pytestmark = needs_triton


def _reference(q, k_cache, v_cache, tables, starts, lens, scale, window, scales=None):
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    ks, vs = scales or (None, None)
    out, row = torch.zeros_like(q), 0
    for i, (pos, n) in enumerate(zip(starts, lens)):
        ctx = pos + n
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(ctx)])
        k = kv_fp8.read(k_cache.view(-1, kv_heads, dim)[slots], ks, torch.float32)
        v = kv_fp8.read(v_cache.view(-1, kv_heads, dim)[slots], vs, torch.float32)
        k, v = (x.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for x in (k, v))
        qp, kp = torch.arange(pos, ctx), torch.arange(ctx)
        mask = kp[None, :] <= qp[:, None]
        if window:
            mask &= kp[None, :] > qp[:, None] - window
        o = F.scaled_dot_product_attention(q[row:row + n].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[row:row + n] = o.transpose(0, 1).to(q.dtype)
        row += n
    return out


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("heads,kv_heads,window,fp8", [(4, 4, 0, False), (8, 2, 0, False), (8, 1, 5, False),
                                                        (8, 2, 100, False), (8, 2, 0, True)])
def test_mixed_rows_match_each_sequences_causal_attention(heads, kv_heads, window, fp8, split, monkeypatch):
    if split:  # ranges past 16 keys split (into key tiles of 64): the chunk after 70 in two, the rows after 200 in 4
        monkeypatch.setattr(triton_mixed, "SPLIT_KEYS", 16)
    torch.manual_seed(0)
    dim, bs, blocks = 16, 4, 100
    dtype = torch.float32
    k_cache = torch.randn(blocks, bs, kv_heads, dim, device=DEVICE)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, device=DEVICE)
    scales = None
    if fp8:
        scales = (0.5, 0.25)
        k_cache = kv_fp8.store(torch.empty(1, dtype=torch.float8_e4m3fn), k_cache, 0.5)
        v_cache = kv_fp8.store(torch.empty(1, dtype=torch.float8_e4m3fn), v_cache, 0.25)
    # decode rows (one token after 9 and 1), a fresh chunk, a chunk after a cached prefix longer than a tile of
    # queries, a chunk after a prefix past one tile of keys, and two rows after four tiles of keys
    starts, lens = [9, 1, 0, 5, 70, 200], [1, 1, 7, 20, 3, 2]
    perm = torch.randperm(blocks).tolist()
    tables = [perm[8 * i:8 * i + 8] for i in range(len(starts))]
    tables[4], tables[5] = perm[:20], perm[30:81]
    width = max(len(t) for t in tables)
    table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    query_starts = [0]
    for n in lens:
        query_starts.append(query_starts[-1] + n)
    q = torch.randn(query_starts[-1] + 3, heads, dim, device=DEVICE, dtype=dtype)  # 3 rows no tile names
    per = triton_mixed.block_q(heads, kv_heads)
    tiles, merges = triton_mixed.cut(query_starts, starts, per, window)
    if split:  # (a window of 5 keys reads too few to split; one of 100 splits the rows after 200 in three)
        assert merges or window == 5
    else:
        assert not merges
    spare = triton_mixed.most_tiles(q.shape[0], 8, per) - len(tiles)
    assert spare >= 0
    tiles = torch.tensor(tiles + [triton_mixed.NO_TILE] * spare, dtype=torch.int32, device=DEVICE)
    merges = torch.tensor(merges + [triton_mixed.NO_MERGE] * (triton_mixed.most_merges() - len(merges)),
                          dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    triton_mixed.attend(q, k_cache, v_cache, table_rows, tiles, 0.3, window, scales, out=out, merges=merges)
    want = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables, starts, lens, 0.3, window, scales)
    n = query_starts[-1]
    torch.testing.assert_close(out[:n].cpu(), want[:n], atol=2e-3 if fp8 else 1e-4, rtol=1e-3)
    assert (out[n:] == 7.0).all()


def test_the_tiles_cut_every_sequence_in_order():
    assert triton_mixed.cut([0, 1, 2, 40], [9, 3, 0], 16) == ([
        (0, 0, 1, 9, 0, 10, -1, 0), (1, 1, 1, 3, 0, 4, -1, 0), (2, 2, 16, 0, 0, 16, -1, 0),
        (2, 18, 16, 16, 0, 32, -1, 0), (2, 34, 6, 32, 0, 38, -1, 0)], [])


def test_long_key_ranges_are_split_into_slots_and_merged():
    tiles, merges = triton_mixed.cut([0, 1], [2000], 16)  # 2,001 keys: four parts of 512 (8 key tiles)
    assert tiles == [(0, 0, 1, 2000, b, min(b + 512, 2001), j, 0) for j, b in enumerate(range(0, 2001, 512))]
    assert merges == [(0, 1, 0, 4)]
    assert triton_mixed.cut([0, 1], [2000], 16, window=100) == ([(0, 0, 1, 2000, 1856, 2001, -1, 0)], [])
    many, merges = triton_mixed.cut(list(range(0, 101)), [4000] * 100, 16)  # 100 long rows share the slots
    assert sum(c for *_, c in merges) <= triton_mixed.PARTS and len(merges) <= triton_mixed.most_merges()
    assert len(many) <= triton_mixed.most_tiles(100, 100, 16)
    assert sorted({t[0] for t in many}) == list(range(100))
    assert triton_mixed.block_q(32, 8) == 16 and triton_mixed.block_q(8, 1) == 8 and triton_mixed.block_q(7, 1) == 8
    assert triton_mixed.most_tiles(40, 3, 16) >= 5


def test_the_kernel_builds_for_hopper():
    cases = [("engine.kernels.triton_mixed", "_mixed_kernel",
              {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i32",
               "tiles_ptr": "*i32", "parts_ptr": "*fp32", "ml_ptr": "*fp32", "scale": "fp32", "v_scale": "fp32", "window": "i32", "stride_qt": "i32",
               "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_cb": "i32", "stride_ct": "i32",
               "stride_ch": "i32", "stride_tb": "i32"},
              {"GROUP": 4, "GROUP_P": 4, "BLOCK_Q": 16, "BLOCK_SIZE": 16, "D": 128, "BLOCK_D": 128, "TILE": 64,
               "PRECISION": "tf32", "UPCAST": False, "HALF": False}, {"num_warps": 4, "num_stages": 2}),
             ("engine.kernels.triton_mixed", "_merge_kernel",
              {"parts_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "merges_ptr": "*i32", "stride_ot": "i32",
               "stride_oh": "i32"}, {"GROUP": 4, "GROUP_P": 4, "BLOCK_Q": 16, "D": 128, "BLOCK_D": 128},
              {"num_warps": 4})]
    for result in compile_for_hopper(cases):
        assert "error" not in result, result.get("error")
        assert result["cubin_bytes"] > 0
