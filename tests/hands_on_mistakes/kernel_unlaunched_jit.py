"""Cheat (kernel): a @triton.jit function sits in the file, but the answer comes from torch; it is never launched."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(len(context_lens)):
        start, end, ctx = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(context_lens[i])
        blocks = block_tables[i, :(ctx + bs - 1) // bs].long()
        keys = k_cache[blocks].reshape(-1, Hkv, D)[:ctx].repeat_interleave(Hq // Hkv, dim=1)  # (ctx, Hq, D)
        values = v_cache[blocks].reshape(-1, Hkv, D)[:ctx].repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale  # (Hq, n, ctx)
        future = torch.arange(ctx)[None, :] > torch.arange(ctx - (end - start), ctx)[:, None]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), values)
    return out
