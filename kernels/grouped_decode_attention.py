"""GQA-grouped paged decode attention: one program reads a KV head once for all the query heads that share it.

Decode is memory-bound: a step reads every cached key and value of every request once and does
~2 flops per byte read. The two older decode kernels read more than that: `paged_attention` and
`split_kv_decode` run one program per *query* head, so with G = Hq / Hkv query heads per KV head
(GQA; G = 4 for Llama-3-8B and Qwen3-8B) each KV block is fetched G times, and a
decode row fills one of `tl.dot`'s 16 tile rows. Here the G query heads that share a KV head are the
rows of one tile (padded up to 16, the least `tl.dot` takes), so a block is read once and the tile's
rows do useful work:

    q of one request, (Hq, D), viewed as (Hkv, G, D)      K/V of KV head h: (context, D)
         kv head h ─> rows  [q_hG, q_hG+1, .., q_hG+G-1, 0 .. 0]   (BLOCK_G = max(16, G) rows, a power of 2)
                            S = Q_h @ K_h^T : (BLOCK_G, keys)    O_h = softmax(S) @ V_h : (BLOCK_G, D)

Keys are found through the request's block table, as in the other kernels, several blocks a loop
iteration (KEYS_PER_ITER keys: fewer, longer iterations, more bytes in flight):

    block_tables[i] = [ 7, 2, 9 ]          logical block j -> physical block
    k_cache  [ blk0 | .. | blk2 | .. | blk7 | .. | blk9 ]      each blk: (block_size, Hkv, D)
    key position p: physical block block_tables[i][p // B], slot p % B

Split-KV ("flash-decoding", as in split_kv_decode.py): with few requests, Bd x Hkv programs leave
most SMs idle, so each context is cut into NUM_SPLITS ranges of blocks, each its own program, and a
second kernel merges the partial results by their log-sum-exps. `choose_num_splits` picks the count
from the rows, the longest context and the SM count (a pure function); with `batch_invariant` it is a
fixed number, so a row's ranges, and so its sum order, depend on its own length only.

    for each (request i, KV head h, split s):                       # one program
        q = Q[i, h*G : h*G+G]                                       # (BLOCK_G, D), padded rows 0
        m = -inf, l = 0, acc = 0                                    # per row, fp32
        for each KEYS_PER_ITER keys of split s (from the window's first key on):
            K, V = cache[block_tables[i][pos // B], pos % B, h]     # (KEYS, D) each, masked outside
            S = q @ K^T * scale;  online softmax update of m, l, acc with P @ V
        NUM_SPLITS == 1: O[i, heads] = acc / l
        else: partial O = acc / l, lse = m + log l  ->  merge kernel (split_kv_decode.py's)

Grid: (num_decode_rows, num_kv_heads, NUM_SPLITS); the merge (num_decode_rows, num_q_heads).
A sliding window W (WINDOW > 0): the decode row at position ctx - 1 sees keys ctx - W .. ctx - 1; the
splits cover only the blocks from the one holding key ctx - W on (earlier ones were given back: their
table entries may point anywhere), and keys before ctx - W in that block are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split_kv_decode import _merge_kernel  # flash-decoding's pass 2: the same partial layout

WAVES = 2  # split until the programs fill about this many waves of SMs
MAX_SPLITS = 32  # beyond this the merge and the partials' traffic stop paying
MIN_KEYS_PER_SPLIT = 128  # a split shorter than this is mostly start-up cost
BATCH_INVARIANT_SPLITS = 16  # batch_invariant: every row, alone or batched, is split the same way
KEYS_PER_ITER = 64  # keys one loop iteration reads (several blocks of 16 or 32)


def naive_grouped_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                   window: int = 0) -> torch.Tensor:
    """Reference: per request, each KV head's keys gathered once and attended by its G query heads together.
    q: (Bd, Hq, D), one decode row per request; caches (num_blocks, B, Hkv, D); window > 0: the last `window`
    keys only. Returns (Bd, Hq, D)."""
    Bd, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(Bd):
        ctx = int(context_lens[i])
        first = max(0, ctx - window) if window > 0 else 0  # the first key the row sees
        j0 = first // B  # blocks before it are not read (a sliding group gave them back)
        blocks = block_tables[i, j0: -(-ctx // B)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[first - j0 * B: ctx - j0 * B].float()  # (L, Hkv, D)
        v = v_cache[blocks].reshape(-1, Hkv, D)[first - j0 * B: ctx - j0 * B].float()
        qg = q[i].float().view(Hkv, Hq // Hkv, D)  # (Hkv, G, D): each KV head's query heads side by side
        scores = torch.einsum("hgd,lhd->hgl", qg, k) * scale  # (Hkv, G, L)
        out[i] = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v).reshape(Hq, D).to(q.dtype)
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int | None, num_sms: int,
                      batch_invariant: bool = False) -> int:
    """How many ranges each context is cut into. Without splits there are num_seqs x num_kv_heads programs;
    split until they fill WAVES waves of `num_sms` SMs, keeping >= MIN_KEYS_PER_SPLIT keys a split of the
    longest context (None: unknown, as when a CUDA graph is recorded), at most MAX_SPLITS.
    batch_invariant: always BATCH_INVARIANT_SPLITS, whatever the batch."""
    if batch_invariant:
        return BATCH_INVARIANT_SPLITS
    programs = num_seqs * num_kv_heads
    to_fill = -(-WAVES * num_sms // programs)  # splits that bring the programs to WAVES x SMs
    by_length = MAX_SPLITS if max_context_len is None else max_context_len // MIN_KEYS_PER_SPLIT
    return max(1, min(to_fill, by_length, MAX_SPLITS))


@triton.jit
def _grouped_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale,
    stride_qb, stride_qh,  # q (Bd, Hq, D), D contiguous
    stride_cb, stride_cs, stride_ch,  # k_cache and v_cache (num_blocks, B, Hkv, D), D contiguous
    stride_bt,  # block_tables (Bd, max_blocks)
    GROUP: tl.constexpr,  # G = Hq / Hkv query heads share one KV head: the tile's rows
    BLOCK_G: tl.constexpr,  # G padded to a power of two >= 16 (tl.dot's least row count)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS_PER_ITER: tl.constexpr,  # keys a loop iteration: a multiple of BLOCK_SIZE
    NUM_SPLITS: tl.constexpr,  # 1: write the output; > 1: partials and log-sum-exps for the merge
    WINDOW: tl.constexpr,  # > 0: the row sees its last WINDOW keys only (a sliding-window layer)
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- the tile's rows: the G query heads sharing this KV head ---
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_offs = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_G, D)

    # --- this split's keys: whole blocks from the window's first block on ---
    ctx = tl.load(ctx_ptr + seq)
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(ctx - WINDOW, 0)
    j0 = first_key // BLOCK_SIZE
    per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_SIZE) - j0, NUM_SPLITS)  # blocks a split
    j_lo = j0 + split * per_split
    key_lo = tl.maximum(j_lo * BLOCK_SIZE, first_key)
    key_hi = tl.minimum((j_lo + per_split) * BLOCK_SIZE, ctx)  # an empty split: key_hi <= key_lo

    # --- online softmax over the split, KEYS_PER_ITER keys at a time ---
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM_P), tl.float32)
    t = tl.arange(0, KEYS_PER_ITER)
    for start in range(j_lo * BLOCK_SIZE, key_hi, KEYS_PER_ITER):
        # --- block table -> physical block -> (KEYS_PER_ITER, D) keys and values ---
        k_pos = start + t
        # keys outside the split are never read: a stale NaN would survive a weight of 0 (0 * NaN)
        k_ok = (k_pos >= key_lo) & (k_pos < key_hi)
        phys = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_offs = (phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None] + d[None, :]
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0)  # (KEYS, D)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0)
        # --- scores of all G heads at once ---
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_G, KEYS)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        # --- online softmax update (m stays -inf only before the first key) ---
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # --- the output, or this split's partial and its log-sum-exp (empty split: lse -inf, weight 0) ---
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    row_ok = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out_offs = (seq * NUM_KV_HEADS * GROUP + heads)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + out_offs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        base = (seq * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split  # (BLOCK_G,)
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=row_ok)
        tl.store(part_lse_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe)), mask=g_ok)


def grouped_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                             num_splits: int, window: int = 0, keys_per_iter: int = KEYS_PER_ITER) -> torch.Tensor:
    """q: (Bd, Hq, D), one decode row per request (block_tables/context_lens rows match q's) -> (Bd, Hq, D).
    num_splits from `choose_num_splits`; window > 0: a sliding-window layer's."""
    Bd, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("grouped_decode_attention needs q and the caches contiguous in head_dim, and the two "
                         "caches laid out alike (k_cache.stride() == v_cache.stride())")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if keys_per_iter < 16 or keys_per_iter & (keys_per_iter - 1):
        raise ValueError(f"keys_per_iter={keys_per_iter} must be a power of two >= 16 (a tl.dot side)")
    G = Hq // Hkv
    keys = max(keys_per_iter, B)  # whole blocks a loop iteration
    out = torch.empty(Bd, Hq, D, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part_out = torch.empty(Bd, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(Bd, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:  # the kernel writes `out` itself
        part_out = part_lse = out
    dp = max(16, triton.next_power_of_2(D))
    _grouped_decode_kernel[(Bd, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=G, BLOCK_G=max(16, triton.next_power_of_2(G)), NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_DIM_P=dp,
        BLOCK_SIZE=B, KEYS_PER_ITER=keys, NUM_SPLITS=num_splits, WINDOW=window,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_splits > 1:
        _merge_kernel[(Bd, Hq)](part_out, part_lse, out, NUM_SPLITS=num_splits,
                                NUM_SPLITS_P=max(2, triton.next_power_of_2(num_splits)), NUM_HEADS=Hq,
                                HEAD_DIM=D, HEAD_DIM_P=dp)
    return out
