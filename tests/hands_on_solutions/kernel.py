"""Reference solution, hands-on 2: paged attention as a Triton kernel, one program per (query row, query
head), an online softmax over the row's KV blocks (graded by
`python -m minivllm.teaching.grade_hands_on kernel tests/hands_on_solutions/kernel.py`; on CPU it runs in
Triton's interpreter).

Kept out of the student's way; tests/test_hands_on.py grades it and plants mistakes in copies of it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_row(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,  # q, out: (T, Hq, D); caches: (num_blocks, BLOCK_SIZE, Hkv, D)
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, row_seq_ptr,  # row_seq: (T,) each row's request
    scale, stride_bt,  # stride_bt: elements between two rows of block_tables
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    # --- where this row sits: its request, its position in that request's context ---
    seq = tl.load(row_seq_ptr + row)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    pos = ctx - q_len + (row - q_start)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d).to(tl.float32)  # (D,)
    # --- online softmax over the blocks holding keys 0 .. pos ---
    m = tl.full([1], float("-inf"), tl.float32)  # running max
    l = tl.zeros([1], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([HEAD_DIM], tl.float32)  # running sum of exp(score - m) * v
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(0, pos // BLOCK_SIZE + 1):
        phys = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + slots
        visible = k_pos <= pos  # causal (and never past the context: pos < ctx)
        offs = ((phys * BLOCK_SIZE + slots)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=visible[:, None], other=0.0).to(tl.float32)  # (BLOCK_SIZE, D)
        v = tl.load(v_cache_ptr + offs, mask=visible[:, None], other=0.0).to(tl.float32)
        s = tl.where(visible, tl.sum(k * q[None, :], 1) * scale, float("-inf"))  # (BLOCK_SIZE,)
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, acc / l)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    q = q.contiguous()  # the model hands q as a strided view (split from one projection); the kernel reads it densely
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    query_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    row_seq = torch.repeat_interleave(torch.arange(len(query_lens), device=q.device), query_lens.long())  # (T,)
    out = torch.empty_like(q)
    _paged_attention_row[(T, Hq)](q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, row_seq,
                                  scale, block_tables.stride(0), NUM_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D,
                                  BLOCK_SIZE=block_size)
    return out
