"""The GQA-grouped decode kernel against its naive reference: groups of 1-8 query heads a KV head, head dims
64/128, blocks of 16/32, contexts cut into splits, sliding windows, NaN where no context reaches; the split
count rule; a row's bits alone and batched under batch_invariant."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_helpers import give_back_before_windows, make_batch, poison_outside_contexts
from minivllm.kernels.grouped_decode_attention import (BATCH_INVARIANT_SPLITS, MAX_SPLITS, MIN_KEYS_PER_SPLIT,
                                                       choose_num_splits, grouped_decode_attention,
                                                       naive_grouped_decode_attention)
from minivllm.kernels.paged_attention import naive_paged_attention

CONTEXTS = [1, 40, 130]  # one key; a block and a half; 130 keys: splits of uneven size, a partial last iteration


def tolerance(dtype: torch.dtype, v_cache: torch.Tensor) -> float:
    """fp32: the few-ulp differences of another summation order (2e-5 on outputs of size ~1). fp16: the kernel
    rounds the softmax weights to fp16 before P @ V (relative 2^-11 on each, so at most 2^-11 max|V| on the
    output) and the output itself (another 2^-11 |o| <= 2^-11 max|V|)."""
    return 2e-5 if dtype == torch.float32 else 2 * 2.0 ** -11 * float(v_cache.float().abs().max())


def run_case(group: int, head_dim: int, block_size: int, dtype: torch.dtype, num_splits: int, window: int) -> None:
    Hkv = 2
    q, kc, vc, bt, cu, cl = make_batch([1] * len(CONTEXTS), CONTEXTS, group * Hkv, Hkv, head_dim, block_size, dtype)
    ref = naive_grouped_decode_attention(q, kc, vc, bt, cl, 0.125, window)
    if window:
        kc, vc = give_back_before_windows(kc, vc, bt, cu, cl, window)  # NaN blocks before each window
    else:
        poison_outside_contexts(kc, vc, bt, cl)  # NaN in every slot past a context
    out = grouped_decode_attention(q, kc, vc, bt, cl, 0.125, num_splits, window)
    tol = tolerance(dtype, vc[:-1] if window else torch.nan_to_num(vc))
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("group, head_dim, block_size, dtype, num_splits, window", [
    (1, 64, 16, torch.float32, 1, 0),
    (2, 128, 32, torch.float16, 3, 0),
    (4, 64, 16, torch.float32, 4, 20),
    (7, 64, 32, torch.float16, 2, 0),  # G = 7: rows 7..15 of the tile are padding
    (8, 128, 16, torch.float32, 5, 40),
])
def test_matches_the_naive_reference(group, head_dim, block_size, dtype, num_splits, window):
    run_case(group, head_dim, block_size, dtype, num_splits, window)


@pytest.mark.parametrize("keys_per_iter", [16, 128])
def test_any_number_of_keys_an_iteration_gives_the_same_answer(keys_per_iter):
    """One block an iteration, or more keys than a split holds (the iteration masked past its split's end)."""
    q, kc, vc, bt, cu, cl = make_batch([1] * len(CONTEXTS), CONTEXTS, 8, 2, 64, 16, torch.float32)
    ref = naive_grouped_decode_attention(q, kc, vc, bt, cl, 0.125)
    out = grouped_decode_attention(q, kc, vc, bt, cl, 0.125, 3, keys_per_iter=keys_per_iter)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="power of two"):
        grouped_decode_attention(q, kc, vc, bt, cl, 0.125, 3, keys_per_iter=48)


@pytest.mark.slow  # 80 cases, ~1 s each in the interpreter
@pytest.mark.parametrize("group, head_dim, block_size, window",
                         list(itertools.product([1, 2, 4, 7, 8], [64, 128], [16, 32], [0, 24])))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_the_naive_reference_over_the_grid(group, head_dim, block_size, window, num_splits):
    run_case(group, head_dim, block_size, torch.float32 if (group + num_splits) % 2 else torch.float16,
             num_splits, window)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("window", [0, 5, 33])
def test_the_reference_is_plain_attention(group, window):
    """The grouped reference (each KV head read once for its G query heads) equals the one-head-at-a-time
    paged reference, windows included."""
    q, kc, vc, bt, cu, cl = make_batch([1] * 4, [1, 17, 64, 90], group * 2, 2, 32, 16, torch.float32)
    torch.testing.assert_close(naive_grouped_decode_attention(q, kc, vc, bt, cl, 0.25, window),
                               naive_paged_attention(q, kc, vc, bt, cu, cl, 0.25, window), atol=1e-5, rtol=1e-5)


def test_a_misread_key_is_caught():
    """The comparison can fail: one key of one request changed moves that request's output past the tolerance."""
    q, kc, vc, bt, cu, cl = make_batch([1, 1], [40, 70], 8, 2, 64, 16, torch.float32)
    ref = naive_grouped_decode_attention(q, kc, vc, bt, cl, 0.125)
    vc[int(bt[1, 2]), 3] += 1.0  # key 35 of request 1
    out = grouped_decode_attention(q, kc, vc, bt, cl, 0.125, 2)
    assert (out[1] - ref[1]).abs().max() > 1e-3
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=0)


def test_fixed_splits_give_a_row_the_same_bits_alone_and_batched():
    """batch_invariant: the split count does not depend on the batch, and each row's ranges depend on its own
    length only, so a row computed beside others equals the row computed alone, bit for bit."""
    q, kc, vc, bt, cu, cl = make_batch([1] * 3, [20, 130, 75], 8, 2, 64, 16, torch.float32)
    batched = grouped_decode_attention(q, kc, vc, bt, cl, 0.125, choose_num_splits(3, 2, 130, 132, True))
    alone = grouped_decode_attention(q[1:2], kc, vc, bt[1:2], cl[1:2], 0.125, choose_num_splits(1, 2, 130, 132, True))
    assert torch.equal(batched[1:2], alone)


def test_the_split_count_fills_the_sms_without_splitting_short_contexts():
    # batch 1, 8 KV heads, 132 SMs: 8 programs; split to fill two waves (33), within MAX_SPLITS
    assert choose_num_splits(1, 8, 4096, 132) == min(33, MAX_SPLITS, 4096 // MIN_KEYS_PER_SPLIT)
    assert choose_num_splits(32, 8, 4096, 132) == 2  # 256 programs: two splits reach 2 x 132
    assert choose_num_splits(64, 8, 4096, 132) == 1  # 512 programs already fill two waves
    assert choose_num_splits(1, 8, 300, 132) == 300 // MIN_KEYS_PER_SPLIT  # short: a split keeps enough keys
    assert choose_num_splits(1, 8, 50, 132) == 1  # never 0
    assert choose_num_splits(1, 1, None, 132) == MAX_SPLITS  # a graph's plan: lengths unknown
    for rows, ctx in [(1, 50), (3, 4096), (64, 9000)]:
        assert choose_num_splits(rows, 8, ctx, 132, batch_invariant=True) == BATCH_INVARIANT_SPLITS


def test_refuses_a_cache_read_as_contiguous_when_it_is_not():
    q, kc, vc, bt, cu, cl = make_batch([1], [20], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        grouped_decode_attention(q, kc.transpose(-1, -2), vc.transpose(-1, -2), bt, cl, 0.125, 1)
