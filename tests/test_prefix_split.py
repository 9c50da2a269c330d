"""``engine.kernels.prefix_split``: a chunk after a prefix, attended as the prefix unmasked plus itself causal, two
fused calls merged by their log-sum-exps, equals one masked softmax over the whole context (the CPU flash kernel
runs the same merge the cuDNN one does on CUDA), and only half-precision CUDA without a window takes the path."""
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import prefix_split


@pytest.mark.parametrize("prefix,chunk", [(1, 1), (16, 48), (300, 17), (1000, 256)])
def test_the_merge_equals_one_softmax_over_prefix_and_chunk(prefix, chunk):
    torch.manual_seed(prefix + chunk)
    heads, dim = 4, 64
    q = torch.randn(heads, chunk, dim)
    k, v = torch.randn(heads, prefix + chunk, dim), torch.randn(heads, prefix + chunk, dim) * 3
    mask = torch.arange(prefix + chunk)[None, :] <= torch.arange(prefix, prefix + chunk)[:, None]
    want = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=dim ** -0.5)[0]
    got = prefix_split.attend(q, k, v, prefix, dim ** -0.5, "cpu")
    assert got.dtype == q.dtype and got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), float((got - want).abs().max())


def test_only_half_precision_cuda_without_a_window_takes_it():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert prefix_split.usable(cuda, torch.bfloat16, None) and prefix_split.usable(cuda, torch.float16, 0)
    assert not prefix_split.usable(cuda, torch.float32, None)
    assert not prefix_split.usable(cuda, torch.bfloat16, 4096)
    assert not prefix_split.usable(cpu, torch.bfloat16, None)
