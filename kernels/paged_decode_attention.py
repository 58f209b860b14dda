"""`paged_decode_attention`: attention for decode rows on CPU, reading K/V where they lie in the cache.

A decode step has one query token per request, and its attention reads the request's whole context.
The PyTorch backend (layers/torch_attention.py) does that in two moves: gather every request's blocks
into one padded (B, Hkv, K, D) tensor (two `index_select`s, a copy of all the contexts), then one SDPA
call with a key-length mask. For the small models this engine runs on a CPU both are mostly fixed
cost: the copy, a mask, and SDPA's set-up, 150-2 500 µs a layer for work that is a few thousand dot
products of 64 numbers.

The C++ kernel (paged_decode_attention.cpp, its header shows the loops) walks each request's block
table instead: one task per (request, KV head), the G query heads that share the KV head done
together, so each key and value row is read once, in place:

    s[g][t] = scale * q[g] . K[t]            for each key t of the context
    p[g]    = softmax(s[g])                  exactly (the scores of one task fit in a small buffer)
    o[g]    = sum_t p[g][t] V[t]

No copy, no mask, no padding. A sliding-window layer passes `window`: the loops start at key
max(0, context - window), so the blocks before the window are never read (they may be given back).
It is built with the other CPU kernels (kernels/cpu_build.py) and
used by the PyTorch backend where warm-up measured it faster than gather + SDPA.

`naive_paged_decode_attention` is the plain-PyTorch reference; tests/kernels compare them.
"""

from __future__ import annotations

import torch


def naive_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float, window: int = 0) -> torch.Tensor:
    """Reference. q (B, Hq, D), one decode token per request; caches (num_blocks, block_size, Hkv, D);
    block_tables (B, max_blocks); context_lens (B,); window > 0: only the last `window` keys (a
    sliding-window layer). Returns (B, Hq, D), computed in fp32."""
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        ctx = int(context_lens[b])
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(Hq // Hkv, dim=1)  # (ctx, Hq, D)
        v = v_cache[blocks].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(Hq // Hkv, dim=1)
        first = max(0, ctx - window) if window > 0 else 0  # the keys before it are not seen
        k, v = k[first:], v[first:]
        p = (torch.einsum("hd,khd->hk", q[b].float(), k) * scale).softmax(-1)  # (Hq, keys)
        out[b] = torch.einsum("hk,khd->hd", p, v).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0) -> torch.Tensor:
    """The compiled kernel (call `load_cpu_kernels()` first; it must say available). block_tables int32,
    context_lens int64; q and the caches float32 or bfloat16, one dtype; window > 0: the last `window` keys
    only, whose blocks alone are read (the table's entries before them are never dereferenced)."""
    return torch.ops.minivllm_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                         window)
