"""Split-KV decode ("flash-decoding"): long contexts, few decode rows.

With one query row per request, the paged-attention kernel runs one program per (request, head):
too few programs to fill a GPU when there are few requests, each walking a long context alone.
Flash-decoding cuts every context into NUM_SPLITS ranges of KV blocks, computes each range's
partial attention in its own program, then merges the partials exactly using each one's
log-sum-exp:

    context blocks   [b0 b1 b2 b3 | b4 b5 b6 b7 | b8 b9]        NUM_SPLITS = 3
                        split 0       split 1      split 2
                          |             |            |
    pass 1:           (o0, lse0)    (o1, lse1)   (o2, lse2)      o_s = softmax-weighted V over
                          \\            |            /            the split's keys, lse_s = log Σ exp(s)
    pass 2 (merge):   m = max_s lse_s;  w_s = exp(lse_s - m);   o = Σ w_s o_s / Σ w_s

Grid: pass 1 (num_decode_rows, num_q_heads, NUM_SPLITS); pass 2 (num_decode_rows, num_q_heads).
A sliding window W (WINDOW > 0): the splits cover only the blocks from the one holding key ctx - W on,
and keys before ctx - W are masked; the blocks before are never read (the sliding group gave them back).

One pass-1 program: one query row, one head, one range of blocks, with a scalar online softmax
(one row cannot use tl.dot, which needs 16 rows, so scores are elementwise products summed over D).

The step after it: grouped_decode_attention.py, what the Triton backend runs for decode steps now. Here the
G query heads sharing a KV head each read its blocks (G reads a block), one block a loop iteration: on an
H200 this kernel reached 5-9 % of copy bandwidth (docs/guides/benchmarks.md). The grouped kernel makes
those G heads the rows of one tl.dot tile and reads several blocks an iteration; it reuses `_merge_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def naive_split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          num_splits: int, window: int = 0) -> torch.Tensor:
    """Reference that follows the same two passes in PyTorch. q: (Bd, Hq, D), one row per request; window > 0:
    the last `window` keys only, split from the block holding the first of them."""
    Bd, Hq, D = q.shape
    Hkv, B = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(Bd):
        ctx = int(context_lens[i])
        first_key = max(0, ctx - window) if window > 0 else 0
        j0 = first_key // B
        per = -(-(-(-ctx // B) - j0) // num_splits)
        partial, lses = [], []
        for s in range(num_splits):
            lo, hi = (j0 + s * per) * B, min((j0 + (s + 1) * per) * B, ctx)
            if lo >= hi:
                continue
            blocks = block_tables[i, j0 + s * per: -(-hi // B)].long()
            k = k_cache[blocks].reshape(-1, Hkv, D)[: hi - lo].float().repeat_interleave(Hq // Hkv, 1)
            v = v_cache[blocks].reshape(-1, Hkv, D)[: hi - lo].float().repeat_interleave(Hq // Hkv, 1)
            scores = torch.einsum("hd,khd->hk", q[i].float(), k) * scale  # (Hq, keys)
            scores[:, :max(0, first_key - lo)] = float("-inf")  # before the window (its first block only)
            lses.append(torch.logsumexp(scores, -1))  # (Hq,)
            partial.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
        lse = torch.stack(lses)  # (splits, Hq)
        w = torch.exp(lse - lse.max(0).values).unsqueeze(-1)  # (splits, Hq, 1)
        out[i] = ((w * torch.stack(partial)).sum(0) / w.sum(0)).to(q.dtype)
    return out


@triton.jit
def _split_kv_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, ctx_ptr, part_out_ptr, part_lse_ptr,
                     scale, stride_bt, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    # --- this split's range of KV blocks ---
    ctx = tl.load(ctx_ptr + row)
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(ctx - WINDOW, 0)
    j0 = first_key // BLOCK_SIZE  # the first block read
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks - j0, NUM_SPLITS)
    j_lo = j0 + split * per_split
    j_hi = tl.minimum(j_lo + per_split, num_blocks)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    # --- online softmax over the range (scalars m, l; vector acc) ---
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((HEAD_DIM_P,), tl.float32)
    for j in range(j_lo, j_hi):
        phys = tl.load(block_tables_ptr + row * stride_bt + j).to(tl.int64)
        kv_offs = ((phys * BLOCK_SIZE + slots)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        # slots past the context are never read: a stale NaN there would survive a weight of 0 (0 * NaN)
        in_ctx = (j * BLOCK_SIZE + slots < ctx) & (j * BLOCK_SIZE + slots >= first_key)  # (BLOCK_SIZE,)
        kv_ok = in_ctx[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, 1) * scale  # (BLOCK_SIZE,)
        s = tl.where(in_ctx, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    # --- partial result and its log-sum-exp (an empty split gets lse = -inf, weight 0) ---
    base = (row * NUM_HEADS + head) * NUM_SPLITS + split
    tl.store(part_out_ptr + base * HEAD_DIM + d, acc / tl.where(l_i == 0.0, 1.0, l_i), mask=d_ok)
    tl.store(part_lse_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))))


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, NUM_SPLITS: tl.constexpr, NUM_SPLITS_P: tl.constexpr,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    # --- weights from the log-sum-exps ---
    s = tl.arange(0, NUM_SPLITS_P)
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # (splits,)
    # --- weighted sum of the partial outputs ---
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=(s < NUM_SPLITS)[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, num_splits: int, window: int = 0) -> torch.Tensor:
    """q: (Bd, Hq, D), one decode row per request (block_tables/context_lens rows match q's); window > 0: a
    sliding-window layer's."""
    Bd, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    part_out = torch.empty(Bd, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(Bd, Hq, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    dp = max(16, triton.next_power_of_2(D))
    _split_kv_kernel[(Bd, Hq, num_splits)](
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale,
        block_tables.stride(0), NUM_SPLITS=num_splits, NUM_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D,
        HEAD_DIM_P=dp, BLOCK_SIZE=B, WINDOW=window)
    _merge_kernel[(Bd, Hq)](part_out, part_lse, out, NUM_SPLITS=num_splits,
                            NUM_SPLITS_P=max(2, triton.next_power_of_2(num_splits)), NUM_HEADS=Hq,
                            HEAD_DIM=D, HEAD_DIM_P=dp)
    return out
