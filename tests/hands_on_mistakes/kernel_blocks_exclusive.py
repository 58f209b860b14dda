"""Reads (pos + B - 1) // B blocks: at pos % B == 0 the block holding pos itself is missed.

A wrong solution from a student walkthrough (tests/test_hands_on_mistakes.py: WRONG)."""
from __future__ import annotations
import torch
import triton
import triton.language as tl


@triton.jit
def _attn_kernel(Q, KC, VC, BT, ROWSEQ, ROWPOS, CTXL, OUT, scale,
                 stride_qt, stride_qh, stride_bt, max_blocks,
                 HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(ROWSEQ + row)
    pos = tl.load(ROWPOS + row)
    kvh = head // GROUP
    d = tl.arange(0, HEAD_DIM)
    s_off = tl.arange(0, BLOCK_SIZE)
    q = tl.load(Q + row * stride_qt + head * stride_qh + d).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    nblk = (pos + BLOCK_SIZE - 1) // BLOCK_SIZE
    for j in range(0, nblk):
        phys = tl.load(BT + seq * stride_bt + j).to(tl.int64)
        offs = ((phys * BLOCK_SIZE + s_off[:, None]) * HKV + kvh) * HEAD_DIM + d[None, :]
        K = tl.load(KC + offs).to(tl.float32)
        V = tl.load(VC + offs).to(tl.float32)
        s = tl.sum(K * q[None, :], axis=1) * scale
        kpos = j * BLOCK_SIZE + s_off
        s = tl.where(kpos <= pos, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * V, axis=0)
        m = m_new
    tl.store(OUT + (row * (HKV * GROUP) + head) * HEAD_DIM + d, acc / l)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    T, H, D = q.shape
    nb, bs, hkv, _ = k_cache.shape
    cu = cu_seqlens_q.tolist()
    cl = context_lens.tolist()
    rowseq, rowpos = [], []
    for i in range(len(cl)):
        ql = cu[i + 1] - cu[i]
        for r in range(ql):
            rowseq.append(i)
            rowpos.append(cl[i] - ql + r)
    n = len(rowseq)
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    if n == 0:
        return out.to(q.dtype)
    rs = torch.tensor(rowseq, dtype=torch.int32, device=q.device)
    rp = torch.tensor(rowpos, dtype=torch.int32, device=q.device)
    bt = block_tables.contiguous()
    _attn_kernel[(n, H)](q, k_cache, v_cache, bt, rs, rp, context_lens, out, scale,
                         q.stride(0), q.stride(1), bt.stride(0), bt.shape[1],
                         HKV=hkv, GROUP=H // hkv, BLOCK_SIZE=bs, HEAD_DIM=D)
    return out.to(q.dtype)
