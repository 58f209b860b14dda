"""Split-KV (flash-decoding) decode against its naive two-pass reference and plain attention."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import give_back_before_windows, make_batch, poison_outside_contexts
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


def test_nan_outside_every_context_is_never_read():
    """Block tails past a context and the table's padding may hold anything a reused block held (NaN included)."""
    q, kc, vc, bt, _, cl = make_batch([1, 1, 1], [17, 64, 130], 8, 2, 64, 16, torch.float32)
    clean = split_kv_decode(q, kc, vc, bt, cl, 0.125, 3)
    poison_outside_contexts(kc, vc, bt, cl)
    torch.testing.assert_close(split_kv_decode(q, kc, vc, bt, cl, 0.125, 3), clean)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sliding_window_splits_only_its_own_blocks(num_splits):
    window, context_lens = 20, [17, 64, 130]
    q, kc, vc, bt, cu, cl = make_batch([1, 1, 1], context_lens, 4, 2, 32, 16, torch.float32)
    plain = naive_paged_attention(q, kc, vc, bt, cu, cl, 0.125, window)
    two_pass = naive_split_kv_decode(q, kc, vc, bt, cl, 0.125, num_splits, window)
    kc, vc = give_back_before_windows(kc, vc, bt, cu, cl, window)
    out = split_kv_decode(q, kc, vc, bt, cl, 0.125, num_splits, window)
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(two_pass, plain, atol=2e-5, rtol=2e-5)
