"""paged_decode_attention (the compiled CPU kernel) against its naive reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import decode_attention_with_error_bound, poison_outside_contexts, require_cpu_kernels
from minivllm.kernels.paged_decode_attention import naive_paged_decode_attention, paged_decode_attention


require_cpu_kernels()


def _case(dtype, Hq, Hkv, D, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# GQA, MHA, D = 80 (5 vectors: chunks of 48 keys), D = 128 (chunks of 32 keys), D = 40 (the generic path)
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (4, 4, 32), (9, 3, 80), (4, 2, 128), (2, 1, 40)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_naive(dtype, Hq, Hkv, D, block_size):
    q, kc, vc, tables, lens = _case(dtype, Hq, Hkv, D, block_size, [1, 5, 16, 17, 63, 130])
    out = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    ref = naive_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert_within_error_bound(out, q, kc, vc, tables, lens, D ** -0.5)
    else:  # the output is rounded to bf16 (2^-8 relative), the reference's too: about two bf16 ulps apart at most
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def assert_within_error_bound(out, q, kc, vc, tables, lens, scale):
    """fp32: within the arithmetic's error bound of the exact answer (kernel_helpers), never a tolerance fitted
    to one CPU; the plain-PyTorch reference must be too (a bound it broke would be wrong, not too strict)."""
    exact, bound = decode_attention_with_error_bound(q, kc, vc, tables, lens, scale)
    for name, got in (("kernel", out), ("naive reference", naive_paged_decode_attention(q, kc, vc, tables, lens, scale))):
        excess = (got.double() - exact).abs() - bound
        worst = int(excess.argmax())
        assert excess.max() <= 0, (f"{name}: element {worst} is {float((got.double() - exact).abs().flatten()[worst]):.3e} "
                                   f"from the exact answer, bound {float(bound.flatten()[worst]):.3e}")


def test_a_row_never_depends_on_the_rows_beside_it():
    q, kc, vc, tables, lens = _case(torch.float32, 6, 2, 64, 16, [3, 40, 77, 128])
    together = paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    alone = torch.cat([paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], 0.125)
                       for i in range(4)])
    assert torch.equal(together, alone)


def test_bad_inputs_are_refused_with_what_to_change():
    q, kc, vc, tables, lens = _case(torch.float32, 6, 2, 64, 4, [5, 9])
    with pytest.raises(RuntimeError, match="outside 1.."):
        paged_decode_attention(q, kc, vc, tables, torch.tensor([5, 99]), 0.125)  # longer than its table
    with pytest.raises(RuntimeError, match="not in the cache"):
        paged_decode_attention(q, kc, vc, torch.full_like(tables, 10_000), lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode_attention(q.bfloat16(), kc, vc, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention(q, kc, vc, tables.long(), lens, 0.125)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 20.0])  # flat to one-hot softmaxes: the vector exp's whole range
def test_matches_naive_from_flat_to_peaked_scores(scale):
    # the scores have a spread of ~8 * scale here: the rounding of large dot products moves a peaked softmax
    # the most, and the bound grows with it (once a fixed atol, fitted on AMD, failed on an Intel Xeon)
    q, kc, vc, tables, lens = _case(torch.float32, 6, 2, 64, 16, [1, 40, 200], seed=3)
    assert_within_error_bound(paged_decode_attention(q, kc, vc, tables, lens, scale), q, kc, vc, tables, lens, scale)


def test_the_error_bound_is_tight_enough_to_catch_a_wrong_key():
    """A test that cannot fail is no test: one key's block swapped for another moves the output past the bound."""
    q, kc, vc, tables, lens = _case(torch.float32, 6, 2, 64, 16, [40], seed=3)
    out = paged_decode_attention(q, kc, vc, tables, lens, 1.0)
    wrong = tables.clone()
    wrong[0, 1] = tables[0, 0]  # keys 16..31 read from the first block
    exact, bound = decode_attention_with_error_bound(q, kc, vc, wrong, lens, 1.0)
    assert ((out.double() - exact).abs() > bound).any()
    assert float(bound.max()) < 1e-3


@pytest.mark.parametrize("D", [64, 40])  # the AVX-512 path and the generic one
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_key_gives_nan_as_torch_does(D, bad):
    """Wherever the key falls, in a 16-lane block or in the tail, its KV head's outputs are NaN (torch's
    softmax over a NaN or +inf score), not a silent average that hides the overflow."""
    for position in (3, 18):
        q, kc, vc, tables, lens = _case(torch.float32, 4, 2, D, 4, [20, 20])
        kc[tables[0, position // 4], position % 4, 1] = bad  # request 0, KV head 1
        out = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
        ref = naive_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
        assert out[0, 2:].isnan().all() and ref[0, 2:].isnan().all()  # the query heads of KV head 1
        torch.testing.assert_close(out[0, :2], ref[0, :2])  # the other KV head, and the other request
        torch.testing.assert_close(out[1], ref[1])


@pytest.mark.parametrize("D", [64, 40])  # the AVX-512 path and the generic one
def test_nan_outside_every_context_is_never_read(D):
    q, kc, vc, tables, lens = _case(torch.float32, 4, 2, D, 4, [5, 17, 2])
    clean = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    poison_outside_contexts(kc, vc, tables, lens)
    assert torch.equal(paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (2, 1, 40)])  # the AVX-512 path and the generic one
def test_a_sliding_window_reads_only_its_last_keys(dtype, Hq, Hkv, D):
    """window W: the last W keys only, and the table's entries before them are never read (a sliding group
    gives those blocks back: here they point outside the cache, which the kernel would refuse if it read them)."""
    block_size, window = 4, 7
    q, kc, vc, tables, lens = _case(dtype, Hq, Hkv, D, block_size, [1, 6, 7, 8, 19, 33])
    out = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, window)
    ref = naive_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, window)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    gone = tables.clone()
    for i, n in enumerate(lens.tolist()):
        gone[i, :max(0, n - window) // block_size] = 10_000  # blocks wholly before the window: not in the cache
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, gone, lens, D ** -0.5, window), out, rtol=0, atol=0)
    full = naive_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    assert not torch.allclose(out.float()[4:], full.float()[4:], atol=1e-3)  # the window changes long rows
