"""``attention.GqaProbe``: a varlen kernel with no ``enable_gqa`` flag gets GQA's K/V heads as they are only once a
first call showed it gives what the repeated heads give; else (an error, a different answer) they stay repeated."""
import torch

from engine.attention import GqaProbe


def _attend(q, k, v):
    """Attention over [tokens, heads, dim] with K/V heads shared by groups of query heads."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 8, 16, generator=g), torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)


def test_a_kernel_that_takes_fewer_kv_heads_gets_them_as_they_are_after_the_first_call():
    q, k, v = _inputs()
    seen, probe = [], GqaProbe()
    call = lambda kk, vv: seen.append(kk.shape[1]) or _attend(q, kk, vv)  # noqa: E731
    want = _attend(q, k, v)
    assert torch.allclose(probe(call, q, k, v), want)
    assert probe.native is True and seen == [8, 2]  # repeated (the answer), then as they are (the probe)
    assert torch.allclose(probe(call, q, k, v), want) and seen[2:] == [2]


def test_a_kernel_that_refuses_or_differs_keeps_getting_the_heads_repeated():
    q, k, v = _inputs()
    def refuses(kk, vv):
        if kk.shape[1] != q.shape[1]:
            raise RuntimeError("Number of heads in key/value must equal the query's")
        return _attend(q, kk, vv)

    for wrong in (refuses, lambda kk, vv: _attend(q, kk, vv) if kk.shape[1] == 8 else torch.zeros_like(q)):
        seen, probe = [], GqaProbe()
        call = lambda kk, vv, wrong=wrong: seen.append(kk.shape[1]) or wrong(kk, vv)  # noqa: E731
        for _ in range(3):
            assert torch.allclose(probe(call, q, k, v), _attend(q, k, v))
        assert probe.native is False and seen == [8, 2, 8, 8]


def test_the_varlen_kernel_on_a_gpu_answers_gqa_as_repeated_heads_do():
    """On CUDA (skipped elsewhere): this torch's varlen kernel through the probe, two packed prompts of GQA 32/8,
    against SDPA over the heads repeated; prints whether the kernel took the fewer heads as they are."""
    import pytest

    from engine import attention
    if not torch.cuda.is_available() or attention.varlen_kernel() is None:
        pytest.skip("needs CUDA and a torch with varlen_attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 91]
    q, k, v = (torch.randn(sum(lens), h, 128, generator=g, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8))
    starts = torch.tensor([0, lens[0], sum(lens)], device="cuda", dtype=torch.int32)
    got = attention.varlen_kernel()(q, k, v, starts, max(lens), 128 ** -0.5, 0)
    want = torch.cat([_causal(q[a:b], k[a:b], v[a:b]) for a, b in ((0, lens[0]), (lens[0], sum(lens)))])
    print("varlen kernel takes GQA's K/V heads as they are:", attention.GQA_PROBE.native)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(attention.varlen_kernel()(q, k, v, starts, max(lens), 128 ** -0.5, 0).float(), want.float(),
                          atol=2e-2, rtol=2e-2)


def _causal(q, k, v):
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)),
                                                            is_causal=True).transpose(0, 1)
