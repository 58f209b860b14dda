"""The C++ silu·mul kernel (kernels/silu_and_mul.cpp) against torch's two ops (naive_silu_and_mul)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from kernel_helpers import assert_same_up_to_last_bits, require_cpu_kernels
from minivllm.kernels.silu_and_mul import naive_silu_and_mul, silu_and_mul

require_cpu_kernels()


# Equal up to how e^-g is computed: fp32's last bits, in bf16 a rare one-ulp step.
assert_same_activation = partial(assert_same_up_to_last_bits, fp32_rtol=4e-7, fp32_atol=1e-30, bf16_atol=1e-30, bf16_equal=0.999)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,I", [(1, 1536), (32, 1536), (5, 16), (3, 17), (7, 40), (600, 96)])
def test_matches_torchs_two_ops(dtype, rows, I):
    g = torch.Generator().manual_seed(rows * I)
    x = (torch.randn(rows, 2 * I, generator=g) * 4).to(dtype)
    assert_same_activation(silu_and_mul(x), naive_silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_strided_view_and_the_far_tails(dtype):
    """Rows of a wider buffer (any row stride); gates far out on both sides, zeros, infinities and NaN, in the
    vector lanes and in the scalar tail (I = 40: 32 values in vectors, 8 after)."""
    x = torch.randn(6, 96).to(dtype)[::2, 8:88]  # (3, 80): I = 40, strided rows
    gate = torch.tensor([-1e4, -120., -88.5, -87.5, -30., -1e-3, 0., 1e-3, 30., 87.5, 88.5, 120., 1e4, float("inf"),
                         float("-inf"), float("nan")] * 2)
    x[0, 8:40] = gate.to(dtype)  # lanes 8-31 in vectors, 32-39 in the scalar tail
    x[1, 24:40] = gate[:16].to(dtype)
    assert not x.is_contiguous() and x.stride(1) == 1
    out, ref = silu_and_mul(x), naive_silu_and_mul(x)
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert_same_activation(torch.where(keep, out, 0), torch.where(keep, ref, 0))


def test_zero_rows_and_bad_inputs():
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        silu_and_mul(torch.randn(2, 8).half())
    with pytest.raises(RuntimeError, match="even"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        silu_and_mul(torch.randn(8, 2).t())
