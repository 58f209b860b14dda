"""Random paged-KV batches for the kernel tests."""

from __future__ import annotations

import os
import random

import pytest
import torch
from minivllm.kernels.cpu_build import load_cpu_kernels


def require_cpu_kernels() -> None:
    """Skip the calling test module (with the reason) where minivllm's C++ CPU kernels cannot be built
    here; CI has a compiler and ninja, so there a failed build fails instead."""
    build = load_cpu_kernels()
    if not build.available:
        assert not os.environ.get("CI"), f"CI must build the CPU kernels: {build.detail}"
        pytest.skip(build.detail, allow_module_level=True)


def assert_same_up_to_last_bits(out: torch.Tensor, ref: torch.Tensor, fp32_rtol: float, fp32_atol: float,
                                bf16_atol: float, bf16_equal: float) -> None:
    """A C++ kernel's result against its naive reference where only the order or the method of one fp32 step
    differs (a sum of squares, an exp): same shape, dtype and contiguity; fp32 within its last bits; bf16
    within one ulp, and equal in at least the `bf16_equal` share of the values."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=fp32_rtol, atol=fp32_atol)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=bf16_atol)  # one bf16 ulp
        assert (out == ref).float().mean() > bf16_equal


def decode_attention_with_error_bound(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The exact answer (float64) of decode attention over a paged cache, and how far from it a float32
    implementation of the usual two-pass softmax may land, element by element: a first-order error bound
    of the arithmetic (worst case in each rounding), so a test's tolerance follows from the inputs, not
    from the CPU it was written on (another summation order, FMA or not, a vectorised exp, the scale
    applied to q or to the score). With u = 2^-24 and g(n) = n u / (1 - n u), per key t:

        score     |ŝ_t - s_t| <= e_t = g(D + 1) scale sum_d |q_d K_td| + 2u |s_t|
                                                    (D products and sums, and the scale, before or after)
        exp       exp(ŝ_t - m) is computed as exp((ŝ_t - m)(1 + η))(1 + δ), |η| <= 2u (the subtraction and
                  a change of base), |δ| <= 8u (a few ulps, any exp): a score error of 2u |s_t - m| + 8u
        softmax   a change δ in the scores moves o by sum_t p_t (δ_t - sum_j p_j δ_j) V_t
                    = sum_t p_t δ_t (V_t - o),  so |δo| <= sum_t p_t (e_t + 2u |s_t - m| + 8u) |V_t - o|
        sums      numerator and denominator over L keys: (2 g(L) + 2u) sum_t p_t |V_t|

    Worst-case bounds sit one to two orders of magnitude above what random inputs give (rounding errors
    mostly cancel), yet one misread key moves the output past them (tested).

    Returns (exact (B, Hq, D) float64, bound (B, Hq, D) float64)."""
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    u = 2.0 ** -24

    def g(n: int) -> float:
        return n * u / (1 - n * u)

    exact = torch.empty(B, Hq, D, dtype=torch.float64)
    bound = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        ctx = int(context_lens[b])
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:ctx].double().repeat_interleave(Hq // Hkv, dim=1)  # (L, Hq, D)
        v = v_cache[blocks].reshape(-1, Hkv, D)[:ctx].double().repeat_interleave(Hq // Hkv, dim=1)
        qb = q[b].double()  # (Hq, D)
        s = torch.einsum("hd,khd->hk", qb, k) * scale  # (Hq, L)
        p = s.softmax(-1)
        o = torch.einsum("hk,khd->hd", p, v)  # (Hq, D)
        e = g(D + 1) * scale * torch.einsum("hd,khd->hk", qb.abs(), k.abs()) + 2 * u * s.abs()  # (Hq, L)
        e = e + 2 * u * (s - s.max(-1, keepdim=True).values).abs() + 8 * u
        spread = (v - o[None]).abs()  # (L, Hq, D)
        bound[b] = (torch.einsum("hk,khd->hd", p * e, spread)
                    + (2 * g(ctx) + 2 * u) * torch.einsum("hk,khd->hd", p, v.abs()))
        exact[b] = o
    return exact, bound


def make_batch(query_lens, context_lens, Hq, Hkv, D, block_size, dtype, seed=0):
    """Random paged caches and a batch whose request i has context_lens[i] tokens, the last
    query_lens[i] of them queried now (the earlier ones are a cached prefix / earlier chunks)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # scattered physical blocks
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used:used + n] + [0] * (width - n))
        used += n
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), Hq, D, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    tables_t = torch.tensor(tables, dtype=torch.int32)
    return q, k_cache, v_cache, tables_t, cu, torch.tensor(context_lens, dtype=torch.int32)


def poison_outside_contexts(k_cache, v_cache, block_tables, context_lens) -> None:
    """NaN into every cache slot no request's context covers (block tails, unused and padding blocks), as a
    reused block may hold from an earlier request or a failed step. Attention must never read them: a key's
    weight of 0 times a NaN value is still NaN."""
    block_size = k_cache.shape[1]
    inside = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for b, ctx in enumerate(context_lens.tolist()):
        for p in range(int(ctx)):
            inside[int(block_tables[b, p // block_size]) * block_size + p % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[~inside] = float("nan")


def give_back_before_windows(k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, window):
    """What a sliding-window KV-cache group does: the blocks wholly before each request's first query's window
    are given back. Their table entries point at one extra block of NaN (someone else's, as far as the request
    knows): a kernel that reads one returns NaN. Returns the caches with that block appended."""
    block_size = k_cache.shape[1]
    nan_block = k_cache.shape[0]
    for i, ctx in enumerate(context_lens.tolist()):
        n = int(cu_seqlens_q[i + 1] - cu_seqlens_q[i])
        block_tables[i, :max(0, ctx - n - window + 1) // block_size] = nan_block
    poison = torch.full((1, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype)
    return torch.cat([k_cache, poison]), torch.cat([v_cache, poison])
