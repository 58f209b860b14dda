"""Paged attention for mixed batches: decode rows, prefill chunks and chunks after a cached prefix,
all in one launch.

The queries are the step's flat varlen batch; request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1],
which are the LAST q_len positions of its context (context_lens[i] tokens, cached + new). Its keys and
values live in the paged cache, found through its row of block_tables:

    block_tables[i] = [ 7, 2, 9 ]          logical block j of request i -> physical block
                        |  |  |
    k_cache  [ blk0 | blk1 | blk2 | ... | blk7 | blk8 | blk9 | ... ]   each blk: (block_size, Hkv, D)
               token position p lives in physical block block_tables[i][p // B], slot p % B

Because the keys are always read through the block table, a chunk whose earlier tokens were
computed in a previous step (chunked prefill) or came from the prefix cache sees them like any
other key: nothing distinguishes "prefill" from "decode" here.

Grid: (num_tiles, num_q_heads). A tile is BLOCK_M consecutive query rows of one request (the host
lists the tiles: `tile_seq`, `tile_start`). One program computes those rows for one query head,
reading the KV head `head // (Hq // Hkv)` (GQA/MQA by grouping).

    for each tile (request i, rows r0 .. r0+BLOCK_M) and head h:        # one program
        q = Q[rows, h]                                  # (BLOCK_M, D)
        m = -inf, l = 0, acc = 0                        # online softmax state, fp32
        for each KV block j the rows can see:           # causal: keys <= the last row's position
            K, V = cache[block_tables[i][j], :, h_kv]   # (B, D) each
            S = q @ K^T * scale, masked where key_pos > query_pos or key_pos >= context_len
            m_new = max(m, rowmax(S));  P = exp(S - m_new)
            l = l * exp(m - m_new) + rowsum(P);  acc = acc * exp(m - m_new) + P @ V;  m = m_new
        O[rows, h] = acc / l

A sliding window W (WINDOW > 0, a Gemma 3 local layer): row p sees keys p - W + 1 .. p only. The loop
then starts at the block holding the tile's first row's first key, and the mask adds key > q_pos - W.
Blocks before that are never read: the sliding KV-cache group has given them back (their table
entries are 0, a block that may belong to anyone).

Head dims that are not a power of two are padded to one (masked); block_size must be a power of
two >= 16 (tl.dot needs >= 16 on every side).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, window: int = 0) -> torch.Tensor:
    """Reference: per request, gather its whole context from the cache and do causal softmax attention
    (window > 0: each row sees its last `window` keys only). q: (T, Hq, D); caches: (num_blocks, B, Hkv, D);
    returns (T, Hq, D)."""
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    B = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(len(context_lens)):
        s, e, ctx = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(context_lens[i])
        n = e - s
        first = max(0, ctx - n - window + 1) // B if window > 0 else 0  # blocks before it are not read
        blocks = block_tables[i, first: -(-ctx // B)].long()
        k = k_cache[blocks].reshape(-1, Hkv, k_cache.shape[-1])[:ctx - first * B].float()  # (keys, Hkv, D)
        v = v_cache[blocks].reshape(-1, Hkv, v_cache.shape[-1])[:ctx - first * B].float()
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # (keys, Hq, D)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale  # (Hq, n, keys)
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(first * B, ctx)[None, :]
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window > 0 else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr,  # (T, Hq, D): the step's flat query rows, and where their outputs go
    k_cache_ptr, v_cache_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D): the paged pool
    block_tables_ptr, stride_bt,  # (num_seqs, max_blocks) int32, and its row stride
    cu_q_ptr, ctx_ptr,  # cu_seqlens_q (num_seqs + 1,) and context_lens (num_seqs,)
    tile_seq_ptr, tile_start_ptr,  # (num_tiles,): each tile's request and first row (plan_tiles)
    scale,  # the softmax scale, head_dim ** -0.5
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # D, and D padded to a power of two
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,  # keys per KV block; query rows per tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (exact), "tf32" for 16-bit inputs
    WINDOW: tl.constexpr,  # > 0: a row sees its last WINDOW keys only (a sliding-window layer)
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)

    # --- which rows: a tile of one request's queries ---
    seq = tl.load(tile_seq_ptr + tile)
    m_start = tl.load(tile_start_ptr + tile)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_offs = ((q_start + rows).to(tl.int64)[:, None] * NUM_HEADS + head) * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D)
    q_pos = ctx - q_len + rows  # absolute position of each query row

    # --- online softmax over the KV blocks these rows can see ---
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_P), tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + m_start + BLOCK_M)  # causal: the last row's position + 1
    j_lo = 0
    if WINDOW > 0:  # the first row's first key: earlier blocks are seen by no row of this tile
        j_lo = tl.maximum(ctx - q_len + m_start - WINDOW + 1, 0) // BLOCK_SIZE
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(j_lo, tl.cdiv(kv_end, BLOCK_SIZE)):
        # --- block table -> physical block -> (BLOCK_SIZE, D) keys and values ---
        phys = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        kv_offs = (((phys * BLOCK_SIZE + slots)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM
                   + d[None, :])  # (BLOCK_SIZE, D): the block's slots, head kv_head
        k_pos = j * BLOCK_SIZE + slots
        # slots past the context are never read: a stale NaN there would survive a weight of 0
        # (0 * NaN = NaN)
        kv_ok = (k_pos < ctx)[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0)
        # --- scores, causal + length mask ---
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_SIZE)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx)
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        # --- online softmax update (rows that see nothing yet keep m = -inf safely) ---
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # --- normalise and store ---
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def plan_tiles(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """Cut every request's query rows into tiles of `block_m`: (tile_seq, tile_start)."""
    tile_seq, tile_start = [], []
    for i, n in enumerate(query_lens):
        for start in range(0, n, block_m):
            tile_seq.append(i)
            tile_start.append(start)
    return tile_seq, tile_start


def check_shapes(head_dim: int, block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton backend needs block_size a power of two >= 16, got {block_size}")
    if head_dim > 256:
        raise ValueError(f"the Triton backend supports head_dim <= 256, got {head_dim}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    tiles: tuple[torch.Tensor, torch.Tensor], block_m: int, window: int = 0) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D). `tiles` from `plan_tiles` (as tensors on q's device); window > 0:
    a sliding-window layer's."""
    T, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    check_shapes(D, B)
    out = torch.empty_like(q)
    tile_seq, tile_start = tiles
    if tile_seq.numel() == 0:
        return out
    _paged_attention_kernel[(tile_seq.numel(), Hq)](
        q.contiguous(), out, k_cache, v_cache, block_tables, block_tables.stride(0), cu_seqlens_q, context_lens,
        tile_seq, tile_start, scale,
        NUM_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_DIM_P=max(16, triton.next_power_of_2(D)),
        BLOCK_SIZE=B, BLOCK_M=block_m, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=window,
    )
    return out
