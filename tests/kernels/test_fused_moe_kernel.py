"""The fused-MoE kernel and its naive reference against a per-token loop in float64 with an error bound, and
moe_align_block_size's invariants. fp32 and fp16 only: Triton's interpreter keeps bf16 as raw 16-bit integers
and its tl.dot multiplies those bits (benchmarks/cuda_check.py checks bf16 compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from minivllm.kernels.fused_moe import MoeBlockConfig, fused_moe, moe_align_block_size, naive_fused_moe

SMALL = MoeBlockConfig(16, 32, 16)  # the interpreter's cost grows with the tile; masking on every side


def make_layer(T, E, k, H, I, dtype, seed=0):
    """Random hidden rows and experts (weights scaled as a trained layer's: outputs of order 1) and HF-style
    routing: softmax over E, top-k, renormalised."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)
    return hidden, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def per_token_loop_with_bound(hidden, w13, w2, topk_weights, topk_ids, u_store):
    """The exact layer, one token and one route at a time in float64, and a first-order bound on how far an
    implementation may land from it when it accumulates in fp32 (u = 2^-24, g(n) = n u / (1 - n u)) and
    rounds its intermediates (gate|up, the activation, each route's output) and its result to a dtype of
    unit roundoff u_store. Per route, with h = w13[e] x, a = silu(gate) * up, y = w2[e] a:
        |dh| <= g(H) |w13[e]| |x| + u_store |h|
        |da| <= 1.1 |up| |d gate| + |silu(gate)| |d up| + (2 u_store + 8 u) |a|     (|silu'| <= 1.1)
        |dy| <= |w2[e]| |da| + g(I) |w2[e]| |a| + (u_store + u) |y|              (the route weight in fp32)
    and over the k routes: w |dy| summed, + g(k) sum |w y| + u_store |out|. Returns (exact (T, H), bound)."""
    u = 2.0 ** -24

    def g(n):
        return n * u / (1 - n * u)

    T, H = hidden.shape
    I = w2.shape[2]
    exact = torch.zeros(T, H, dtype=torch.float64)
    bound = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        x = hidden[t].double()
        magnitude = torch.zeros(H, dtype=torch.float64)
        for j in range(topk_ids.shape[1]):
            e, w = int(topk_ids[t, j]), float(topk_weights[t, j])
            W13, W2 = w13[e].double(), w2[e].double()
            h = W13 @ x  # (2I,)
            dh = g(H) * (W13.abs() @ x.abs()) + u_store * h.abs()
            gate, up = h[:I], h[I:]
            a = F.silu(gate) * up  # (I,)
            da = 1.1 * up.abs() * dh[:I] + F.silu(gate).abs() * dh[I:] + (2 * u_store + 8 * u) * a.abs()
            y = W2 @ a  # (H,)
            dy = W2.abs() @ da + g(I) * (W2.abs() @ a.abs()) + (u_store + u) * y.abs()
            exact[t] += w * y
            bound[t] += abs(w) * dy
            magnitude += abs(w) * y.abs()
        bound[t] += g(topk_ids.shape[1]) * magnitude + u_store * exact[t].abs()
    return exact, bound


def assert_within(out, exact, bound):
    assert out.shape == exact.shape
    excess = (out.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"past the bound by up to {excess.max().item():.3g}"


UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11}

CASES = {  # (T, E, k, H, I, config)
    "decode, 6 of 8 experts unused (default tiles: BLOCK_K 64 > H)": (1, 8, 2, 32, 16, None),
    "counts not multiples of BLOCK_M, odd H and I": (7, 4, 2, 40, 24, SMALL),
    "many experts, k = 4": (12, 16, 4, 32, 32, MoeBlockConfig(32, 16, 32)),
    "the default tiles (prefill-sized: BLOCK_M 64)": (40, 4, 2, 64, 32, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_and_naive_within_the_bound_of_a_per_token_loop(case, dtype):
    T, E, k, H, I, config = CASES[case]
    hidden, w13, w2, weights, ids = make_layer(T, E, k, H, I, dtype)
    exact, bound = per_token_loop_with_bound(hidden, w13, w2, weights, ids, UNIT_ROUNDOFF[dtype])
    out = fused_moe(hidden, w13, w2, weights, ids, config)
    assert out.dtype == dtype and out.is_contiguous()
    assert_within(out, exact, bound)
    assert_within(naive_fused_moe(hidden, w13, w2, weights, ids), exact, bound)


def test_every_route_to_one_expert():
    """20 tokens on expert 3 (k = 1, int32 ids as vLLM's router gives): two blocks of 16, the second with 12
    sentinel rows; the other experts have none."""
    hidden, w13, w2, _, _ = make_layer(20, 6, 1, 32, 16, torch.float32)
    ids = torch.full((20, 1), 3, dtype=torch.int32)
    weights = torch.rand(20, 1, generator=torch.Generator().manual_seed(1))
    exact, bound = per_token_loop_with_bound(hidden, w13, w2, weights, ids, 2.0 ** -24)
    assert_within(fused_moe(hidden, w13, w2, weights, ids, SMALL), exact, bound)


def test_the_bound_catches_one_misrouted_route():
    """The bound is not vacuous: the answer with one route sent to another expert lies outside it."""
    hidden, w13, w2, weights, ids = make_layer(7, 4, 2, 40, 24, torch.float32)
    out = fused_moe(hidden, w13, w2, weights, ids, SMALL)
    wrong = ids.clone()
    wrong[3, 1] = next(e for e in range(4) if e not in ids[3].tolist())
    exact, bound = per_token_loop_with_bound(hidden, w13, w2, weights, wrong, 2.0 ** -24)
    assert ((out.double() - exact).abs() > bound).any()


def test_strided_hidden_rows_are_read_by_their_strides():
    """hidden as a view into wider rows (NaN past column H): a kernel reading it as contiguous returns NaN."""
    hidden, w13, w2, weights, ids = make_layer(5, 4, 2, 32, 16, torch.float32)
    wide = torch.full((5, 48), float("nan"))
    wide[:, :32] = hidden
    torch.testing.assert_close(fused_moe(wide[:, :32], w13, w2, weights, ids, SMALL),
                               fused_moe(hidden, w13, w2, weights, ids, SMALL))


def test_no_tokens_gives_no_rows():
    hidden, w13, w2, weights, ids = make_layer(3, 4, 2, 32, 16, torch.float32)
    assert fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("field, change", [
    ("w2", lambda a: {**a, "w2": a["w2"][:, :, :8]}),
    ("w13", lambda a: {**a, "w13": a["w13"][:, :-1]}),
    ("topk_ids", lambda a: {**a, "topk_ids": a["topk_ids"][:2]}),
    ("topk_ids must be an integer", lambda a: {**a, "topk_ids": a["topk_ids"].float()}),
    ("hidden's dtype", lambda a: {**a, "w2": a["w2"].half()}),
])
def test_bad_inputs_name_the_argument(field, change):
    hidden, w13, w2, weights, ids = make_layer(3, 4, 2, 32, 16, torch.float32)
    args = change(dict(hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids))
    for function in (fused_moe, naive_fused_moe):
        with pytest.raises(ValueError, match=field):
            function(**args)


def test_a_block_config_must_fit_tl_dot():
    with pytest.raises(ValueError, match="block_k=8"):
        MoeBlockConfig(16, 32, 8)
    with pytest.raises(ValueError, match="block_m=24"):
        MoeBlockConfig(24, 32, 16)


def test_alignment_of_the_module_docstring_example():
    aligned = moe_align_block_size(torch.tensor([[2, 0], [1, 2], [0, 2]]), 2, 4)
    assert aligned.sorted_token_ids.tolist()[:8] == [1, 4, 2, 6, 0, 3, 5, 6]
    assert aligned.expert_ids.tolist()[:4] == [0, 1, 2, 2]
    assert aligned.num_tokens_post_padded.tolist() == [8]


@settings(max_examples=80, deadline=None)
@given(T=st.integers(1, 12), E=st.integers(1, 10), k=st.integers(1, 4), block_size=st.integers(1, 8),
       seed=st.integers(0, 2 ** 16))
def test_alignment_invariants(T, E, k, block_size, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # (T, k) distinct per token
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids, block_size, E)
    R, total = T * k, int(post_padded)
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_size - 1) // block_size * block_size  # (E,) no more padding than needed
    assert total == int(padded.sum()) and total % block_size == 0
    assert sorted_ids.numel() >= total and sorted_ids.numel() % block_size == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_size
    used = sorted_ids[:total]
    assert (sorted_ids[total:] == R).all() and (expert_ids[total // block_size:] == -1).all()
    assert sorted(used[used < R].tolist()) == list(range(R))  # every route exactly once
    row_expert = expert_ids[:total // block_size].repeat_interleave(block_size)  # (total,)
    assert (row_expert[1:] >= row_expert[:-1]).all()  # groups in expert order
    assert torch.equal(torch.bincount(row_expert.long(), minlength=E), padded)  # each group its padded count
    real = used < R
    assert torch.equal(flat[used[real].long()], row_expert[real].long())  # each route in its expert's group
    for e in range(E):  # within a group: the routes in order, then the sentinels
        group = used[row_expert == e].tolist()
        assert group == sorted(r for r in group if r < R) + [R] * (int(padded[e]) - int(counts[e]))
