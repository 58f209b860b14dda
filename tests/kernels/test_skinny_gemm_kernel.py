"""skinny_gemm (the compiled CPU kernel) against its naive reference.

CI builds the kernel (it has a compiler and ninja), so there a failed build is a failure; elsewhere a
machine without a compiler skips these tests with the reason, as the matmul plan skips the form. The
code paths for other instruction sets are checked in test_cpu_build.py."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.skinny_gemm import LANES, can_pack_skinny, naive_skinny_gemm, pack_skinny_weight, skinny_gemm


require_cpu_kernels()


def test_the_packed_layout_is_blocks_of_16_output_columns():
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)  # 20 outputs: one full block, one padded
    p = pack_skinny_weight(w)
    assert p.shape == (2, 6, LANES)
    assert torch.equal(p[0, 3], w[:16, 3]) and torch.equal(p[1, 5, :4], w[16:, 5])
    assert p[1, :, 4:].abs().sum() == 0  # padding columns are zero
    pb = pack_skinny_weight(w.bfloat16())
    assert pb.shape == (2, 3, LANES, 2)  # k in pairs
    assert torch.equal(pb[0, 1, 7], w.bfloat16()[7, 2:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("out_f,in_f", [(16, 32), (37, 10), (160, 96), (200, 578)])
def test_matches_naive(dtype, rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    packed = pack_skinny_weight(w)
    for b in (None, bias):
        y = skinny_gemm(x, packed, out_f, b)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        # fp32 sums in another order; bf16 output rounds once more than the fp32 reference
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y.float(), naive_skinny_gemm(x, w, b).float(), **tol)


def test_a_row_never_depends_on_the_rows_beside_it():
    """Rows are grouped by four inside the kernel; each output sums its own row in a fixed order."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g)
    packed = pack_skinny_weight(w)
    alone = torch.cat([skinny_gemm(x[i:i + 1], packed, 48) for i in range(7)])
    assert torch.equal(skinny_gemm(x, packed, 48), alone)


def test_bad_inputs_are_refused_with_what_to_change():
    w = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        skinny_gemm(torch.randn(1, 16).bfloat16(), pack_skinny_weight(w), 32)
    with pytest.raises(RuntimeError, match="features"):
        skinny_gemm(torch.randn(1, 8), pack_skinny_weight(w), 32)
    with pytest.raises(RuntimeError, match="pack_skinny_weight"):  # packed from another out_features
        skinny_gemm(torch.randn(1, 16), pack_skinny_weight(torch.randn(40, 16)), 20)
    with pytest.raises(RuntimeError, match="pack_skinny_weight"):  # the fp32 layout for a bf16 product
        skinny_gemm(torch.randn(1, 16).bfloat16(), pack_skinny_weight(w).bfloat16(), 32)
    with pytest.raises(RuntimeError, match="bias"):
        skinny_gemm(torch.randn(1, 16), pack_skinny_weight(w), 32, torch.randn(2, 16))
    with pytest.raises(ValueError, match="even in_features"):
        pack_skinny_weight(torch.randn(4, 5).bfloat16())
    assert not can_pack_skinny(torch.randn(4, 5).bfloat16()) and not can_pack_skinny(torch.randn(4, 4).half())
