"""Sampling in two small kernels: find each row's cut-off, then draw with Gumbel-max.

All three filters keep "the tokens whose logit is at least some threshold", so a row's filters
combine into ONE number, the largest of their thresholds:
  * top-k:  the k-th largest logit
  * top-p:  the smallest logit of the shortest most-probable prefix holding top_p of the mass
  * min-p:  max_logit + log(min_p)   (p_i >= min_p * p_max, in logit space)

No sort. Thresholds are found by bisection on the float's bit pattern: mapping each fp32 to an int32
key that orders like the floats (flip the magnitude bits of negatives), the answer is the largest key
T with count(key >= T) >= k (or mass(key >= T) >= top_p), found exactly in at most 32 passes over the
row. A sort would cost O(V log V) and a scratch copy of the vocabulary per row; bisection costs 32
reads of a row that stays in cache, and no extra memory.

    pass 1  (_threshold_kernel, one program per row)
        x = logits / T;  m = max(x)
        t_k = bisect(count(x >= t) >= k)            if top_k
        t_p = bisect(Σ_{x >= t} e^(x-m) >= top_p·Z)  if top_p < 1   (Z over the tokens above t_k)
        t_min = m + log(min_p)                       if min_p > 0
        cutoff = max(t_k, t_p, t_min)
    pass 2  (_gumbel_argmax_kernel, one program per row)
        u = philox(seed(request seed, position), vocab index)   # counter-based: no state
        token = argmax over x >= cutoff of (x - log(-log u))     # greedy rows: argmax of x

The noise depends only on (request seed, position, vocab index), so a seeded request draws the same
tokens whatever shares its batch. It is a different random stream from the PyTorch sampler's
(Philox vs. torch.Generator): same distribution, different draws.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .seeding import noise_seed


def naive_cutoffs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  min_ps: torch.Tensor) -> torch.Tensor:
    """Reference for pass 1 with a full sort: the smallest kept (temperature-scaled) logit per row."""
    out = torch.empty(logits.shape[0])
    for r in range(logits.shape[0]):
        t = float(temperatures[r]) or 1.0
        x = logits[r].float() / t
        xs, _ = x.sort(descending=True)
        cut = -math.inf
        k = int(top_ks[r])
        if 0 < k < x.numel():
            cut = max(cut, float(xs[k - 1]))
        if float(top_ps[r]) < 1.0:
            kept = xs[xs >= cut]
            p = (kept - kept[0]).exp()
            p = p / p.sum()
            before = p.cumsum(0) - p  # mass ranked strictly above each token
            cut = max(cut, float(kept[before < float(top_ps[r])][-1]))
        if float(min_ps[r]) > 0.0:
            cut = max(cut, float(xs[0]) + math.log(float(min_ps[r])))
        out[r] = cut
    return out


@triton.jit
def _sortable(x):
    """fp32 -> int32 key with the same order (negative floats: flip the magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _unsortable(key):
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _largest_key_reaching(base, V, inv_t, hi_x, lo, target, BY_MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Bisection on keys: the largest T with measure(x: key(x) >= T) >= target, where the measure
    counts tokens (top-k) or sums exp(x - max) (top-p). Invariant: measure(lo) >= target > measure(hi)."""
    hi = _sortable(hi_x).to(tl.int64) + 1
    while lo + 1 < hi:
        mid = lo + (hi - lo) // 2
        measure = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
            above = (_sortable(x).to(tl.int64) >= mid) & (offs < V)
            if BY_MASS:
                measure += tl.sum(tl.where(above, tl.exp(x - hi_x), 0.0), 0)
            else:
                measure += tl.sum(above.to(tl.float32), 0)
        if measure >= target:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _threshold_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, cutoff_ptr, V, stride,
                      BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    temp = tl.load(temp_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0.0, temp, 1.0)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    # --- max and min of the scaled row ---
    hi_x = float("-inf")
    lo_x = float("inf")
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        hi_x = tl.maximum(hi_x, tl.max(x, 0))
        lo_x = tl.minimum(lo_x, tl.min(tl.where(offs < V, x, float("inf")), 0))
    cut_key = _sortable(lo_x)  # keep everything
    # --- top-k: the largest key with count(key >= T) >= k ---
    if (top_k > 0) & (top_k < V):
        cut_key = _largest_key_reaching(base, V, inv_t, hi_x, cut_key.to(tl.int64), top_k.to(tl.float32),
                                        False, BLOCK_V).to(tl.int32)
    # --- top-p: the largest key whose tokens hold top_p of the mass left after top-k ---
    if top_p < 1.0:
        total = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
            total += tl.sum(tl.where(_sortable(x) >= cut_key, tl.exp(x - hi_x), 0.0), 0)
        cut_key = _largest_key_reaching(base, V, inv_t, hi_x, cut_key.to(tl.int64), top_p * total,
                                        True, BLOCK_V).to(tl.int32)
    # --- min-p, and the combined cut-off ---
    cutoff = _unsortable(cut_key)
    if min_p > 0.0:
        cutoff = tl.maximum(cutoff, hi_x + tl.log(min_p))
    tl.store(cutoff_ptr + row, cutoff)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, cutoff_ptr, seed_ptr, out_ptr, V, stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    cutoff = tl.where(greedy, float("-inf"), tl.load(cutoff_ptr + row))
    seed = tl.load(seed_ptr + row)
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        # --- Gumbel noise from (seed, vocab index): counter-based, so no state between rows ---
        u = tl.rand(seed, offs)
        g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = tl.where(greedy, x, x + g)
        score = tl.where((x >= cutoff) & (offs < V), score, float("-inf"))
        tile_best = tl.max(score, 0)
        tile_i = tl.min(tl.where(score == tile_best, offs, V), 0)  # first index of the tile's max
        better = tile_best > best
        best_i = tl.where(better, tile_i, best_i)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_i)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def compute_cutoffs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                    min_ps: torch.Tensor) -> torch.Tensor:
    S, V = logits.shape
    cutoffs = torch.empty(S, dtype=torch.float32, device=logits.device)
    _threshold_kernel[(S,)](logits, temperatures, top_ks, top_ps, min_ps, cutoffs, V, logits.stride(0),
                            BLOCK_V=min(4096, triton.next_power_of_2(V)))
    return cutoffs


def triton_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  min_ps: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """logits (S, V); per-row parameters as (S,) tensors (top_k: V or 0 = off); returns (S,) int64."""
    logits = logits.float().contiguous()
    cutoffs = compute_cutoffs(logits, temperatures, top_ks.to(torch.int32), top_ps, min_ps)
    return gumbel_argmax(logits, temperatures, cutoffs, seeds, positions)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, cutoffs: torch.Tensor, seeds: list[int],
                  positions: list[int]) -> torch.Tensor:
    """Pass 2 alone: draw each row among its logits >= cutoff (temperature-scaled)."""
    S, V = logits.shape
    keys = torch.tensor([_signed64(noise_seed(s, p)) for s, p in zip(seeds, positions)], dtype=torch.int64)
    if logits.device.type == "cuda":  # from pinned memory, asynchronously: a pageable copy waits for the GPU
        keys = keys.pin_memory().to(logits.device, non_blocking=True)
    out = torch.empty(S, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(S,)](logits, temperatures, cutoffs, keys, out, V, logits.stride(0),
                                BLOCK_V=min(4096, triton.next_power_of_2(V)))
    return out.long()
