"""The mixed-batch paged-attention kernel against its naive reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import give_back_before_windows, make_batch, poison_outside_contexts
from minivllm.kernels.paged_attention import naive_paged_attention, paged_attention, plan_tiles


def run_both(query_lens, context_lens, Hq=4, Hkv=2, D=64, block_size=16, dtype=torch.float32, poison=False):
    q, kc, vc, bt, cu, cl = make_batch(query_lens, context_lens, Hq, Hkv, D, block_size, dtype)
    if poison:
        poison_outside_contexts(kc, vc, bt, cl)
    ts, st = plan_tiles(query_lens, 16)
    tiles = (torch.tensor(ts, dtype=torch.int32), torch.tensor(st, dtype=torch.int32))
    out = paged_attention(q, kc, vc, bt, cu, cl, D ** -0.5, tiles, 16)
    ref = naive_paged_attention(q, kc, vc, bt, cu, cl, D ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_decode_prefill_and_cached_prefix(dtype):
    # decode (1 of 17) | fresh prefill (20 of 20) | chunk after a cached prefix (5 of 40) | 1-token prompt
    run_both([1, 20, 5, 1], [17, 20, 40, 1], dtype=dtype)


@pytest.mark.parametrize("lengths", [
    ([16], [16]), ([17], [17]), ([15], [15]),  # on, past and before a block boundary
    ([1, 1, 1], [16, 32, 33]),  # decodes whose context ends on / across boundaries
    ([3, 18], [35, 18]),  # ragged
])
def test_block_boundaries_and_ragged_lengths(lengths):
    run_both(*lengths)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])  # GQA ratios 1, 2, 4, 8
def test_gqa_ratios(Hq, Hkv):
    run_both([2, 1], [9, 30], Hq=Hq, Hkv=Hkv)


@pytest.mark.parametrize("D,block_size", [(128, 16), (64, 32), (80, 16)])  # 80 is padded to 128
def test_head_dims_and_block_sizes(D, block_size):
    run_both([3, 1], [40, 21], Hq=2, Hkv=1, D=D, block_size=block_size)


def test_nan_outside_every_context_is_never_read():
    """Block tails past a context and padding blocks may hold anything a reused block held (NaN included)."""
    run_both([1, 20, 5, 1], [17, 20, 40, 1], poison=True)


def test_refuses_unsupported_block_sizes():
    with pytest.raises(ValueError, match="power of two >= 16"):
        run_both([1], [4], block_size=8)


@pytest.mark.parametrize("window", [5, 20, 33])  # inside one block, across blocks, longer than a tile
def test_a_sliding_window_sees_its_last_keys_and_never_reads_before_them(window):
    query_lens, context_lens = [1, 20, 5, 1, 3], [17, 20, 40, 70, 3]
    q, kc, vc, bt, cu, cl = make_batch(query_lens, context_lens, 4, 2, 32, 16, torch.float32)
    ref = naive_paged_attention(q, kc, vc, bt, cu, cl, 32 ** -0.5, window)
    assert not torch.allclose(ref, naive_paged_attention(q, kc, vc, bt, cu, cl, 32 ** -0.5), atol=1e-3)
    kc, vc = give_back_before_windows(kc, vc, bt, cu, cl, window)
    ts, st = plan_tiles(query_lens, 16)
    tiles = (torch.tensor(ts, dtype=torch.int32), torch.tensor(st, dtype=torch.int32))
    out = paged_attention(q, kc, vc, bt, cu, cl, 32 ** -0.5, tiles, 16, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(naive_paged_attention(q, kc, vc, bt, cu, cl, 32 ** -0.5, window), ref)
