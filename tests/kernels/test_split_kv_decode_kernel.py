"""Split-KV (flash-decoding) decode against its naive two-pass reference and plain attention."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_batch
from minivllm.kernels.paged_attention import naive_paged_attention
from minivllm.kernels.split_kv_decode import naive_split_kv_decode, split_kv_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_matches_references(dtype, num_splits):
    context_lens = [17, 64, 130]  # the last one: splits of uneven size; the first: empty splits
    q, kc, vc, bt, _, cl = make_batch([1, 1, 1], context_lens, 8, 2, 64, 16, dtype)
    out = split_kv_decode(q, kc, vc, bt, cl, 0.125, num_splits)
    two_pass = naive_split_kv_decode(q, kc, vc, bt, cl, 0.125, num_splits)
    plain = naive_paged_attention(q, kc, vc, bt, torch.arange(4, dtype=torch.int32), cl, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), two_pass.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), plain.float(), atol=tol, rtol=tol)
