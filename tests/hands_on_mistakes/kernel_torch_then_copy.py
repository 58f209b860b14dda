"""The attention computed in torch, then a trivial @triton.jit kernel launched to copy the answer out.

A wrong solution from a student walkthrough (tests/test_hands_on_mistakes.py: WRONG)."""
from __future__ import annotations
import math
import torch
import triton
import triton.language as tl


@triton.jit
def _copy(SRC, DST, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < N), mask=i < N)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    T, H, D = q.shape
    nb, bs, hkv, _ = k_cache.shape
    group = H // hkv
    res = torch.zeros(T, H, D, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for i, cl in enumerate(context_lens.tolist()):
        s0, s1 = cu[i], cu[i + 1]
        ql = s1 - s0
        blocks = block_tables[i, :math.ceil(cl / bs)].long()
        kk = k_cache[blocks].reshape(-1, hkv, D)[:cl].float().repeat_interleave(group, 1)
        vv = v_cache[blocks].reshape(-1, hkv, D)[:cl].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[s0:s1].float(), kk) * scale
        qp = torch.arange(cl - ql, cl)[:, None]
        s = s.masked_fill(torch.arange(cl)[None] > qp, float("-inf"))
        res[s0:s1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    out = torch.empty_like(res)
    n = res.numel()
    _copy[(triton.cdiv(n, 1024),)](res, out, n, BLOCK=1024)  # "the kernel writes the output"
    return out.to(q.dtype)
