"""The C++ RMSNorm kernels (kernels/rms_norm.cpp) against HF's order of operations (naive_rms_norm)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from kernel_helpers import assert_same_up_to_last_bits, require_cpu_kernels
from minivllm.kernels.rms_norm import fused_add_rms_norm, naive_fused_add_rms_norm, naive_rms_norm, rms_norm

require_cpu_kernels()


# Equal up to the order the squares are summed in: the last bit of r, so in bf16 a rare one-ulp step.
assert_same_norm = partial(assert_same_up_to_last_bits, fp32_rtol=2e-6, fp32_atol=1e-6, bf16_atol=1e-2, bf16_equal=0.99)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,N", [(1, 384), (33, 576), (5, 64), (3, 17), (7, 80), (600, 384)])
def test_matches_hf_order(dtype, rows, N):
    g = torch.Generator().manual_seed(rows * N)
    x = (torch.randn(rows, N, generator=g) * 3).to(dtype)
    w = torch.randn(N, generator=g).to(dtype)
    assert_same_norm(rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_of_a_strided_view(dtype):
    """Qwen3's q/k norms: (T, H, D) views of the fused qkv output, heads and rows strided."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 10, 48, generator=g).to(dtype)  # 6 q heads, 2 k heads, 2 v heads
    w = torch.randn(48, generator=g).to(dtype)
    for view in (qkv[:, :6], qkv[:, 6:8], qkv[::2, 1:5]):
        assert_same_norm(rms_norm(view, w, 1e-5), naive_rms_norm(view, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,N", [(1, 384), (32, 384), (4, 19), (300, 96)])
def test_fused_add_returns_the_sum_and_its_norm(dtype, rows, N):
    g = torch.Generator().manual_seed(rows + N)
    x, res = ((torch.randn(rows, N, generator=g) * 2).to(dtype) for _ in range(2))
    w = torch.randn(N, generator=g).to(dtype)
    out, h = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_h = naive_fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, ref_h)  # one rounded add: exact
    assert_same_norm(out, ref_out)


def test_zero_rows_large_values_and_bad_inputs():
    w = torch.ones(8)
    assert rms_norm(torch.empty(0, 8), w, 1e-6).shape == (0, 8)
    big = torch.full((2, 8), 3e38)  # the squares overflow fp32: inf, as torch's mean of squares does
    torch.testing.assert_close(rms_norm(big, w, 1e-6), naive_rms_norm(big, w, 1e-6))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rms_norm(torch.randn(2, 8).half(), w.half(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        rms_norm(torch.randn(8, 2).t(), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual must have"):
        fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w, 1e-6)
