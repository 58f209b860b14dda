"""The C++ greedy argmax (kernels/greedy_argmax.cpp) against torch.argmax: ties, NaN, -inf, tails."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.greedy_argmax import greedy_argmax, naive_greedy_argmax

require_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,V", [(1, 32000), (33, 49152), (5, 17), (3, 15), (2, 1), (4, 100)])
def test_matches_torch_argmax(dtype, S, V):
    g = torch.Generator().manual_seed(S * V)
    x = torch.randn(S, V, generator=g).to(dtype)
    assert torch.equal(greedy_argmax(x), naive_greedy_argmax(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nan_and_infinities_follow_torch(dtype):
    V = 50
    x = torch.zeros(8, V, dtype=dtype)
    x[0, [7, 23, 40]] = 3.0  # ties in different lanes: the first
    x[1, [4, 20, 36]] = 3.0  # ties in the same lane
    x[2, 47] = 3.0  # only in the scalar tail
    x[2, 3] = 3.0  # ... tied with an earlier one
    x[3, 30] = float("nan")
    x[3, 40] = float("nan")  # the first NaN wins, whatever the values
    x[3, 2] = float("inf")
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 49] = float("nan")  # a NaN in the tail
    x[6, 10] = float("inf")
    x[7] = -1.0
    x[7, 18] = -0.5
    assert greedy_argmax(x).tolist() == naive_greedy_argmax(x).tolist() == [7, 4, 3, 30, 0, 49, 10, 18]


def test_rows_with_a_stride_and_bad_inputs():
    x = torch.randn(6, 64)
    assert torch.equal(greedy_argmax(x[::2]), naive_greedy_argmax(x[::2]))  # rows 128 apart
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        greedy_argmax(x.half())
    with pytest.raises(RuntimeError, match="each row contiguous"):
        greedy_argmax(x.t())
