"""KV-cache write ("reshape_and_cache" in vLLM): store each new token's K and V at its slot.

    slot_mapping[t] = block_id * block_size + offset          (-1: nothing to store)

    token t ──slot──> k_cache.view(num_blocks * block_size, Hkv, D)[slot] = k[t]
                      v_cache.view(num_blocks * block_size, Hkv, D)[slot] = v[t]

Grid: one program per token; it copies that token's (Hkv * D) keys and values.

    for t in parallel:
        slot = slot_mapping[t]
        if slot < 0: return
        k_cache[slot] = k[t];  v_cache[slot] = v[t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def naive_kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """k, v: (T, Hkv, D); caches: (num_blocks, block_size, Hkv, D); slot_mapping: (T,)."""
    keep = slot_mapping >= 0
    Hkv, D = k.shape[1], k.shape[2]
    k_cache.view(-1, Hkv, D)[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, Hkv, D)[slot_mapping[keep]] = v[keep]


@triton.jit
def _kv_cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row_size: tl.constexpr,
                           BLOCK: tl.constexpr):
    t = tl.program_id(0)
    # --- which slot ---
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    # --- copy one token's K and V (Hkv * D values each) ---
    for start in range(0, row_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_size
        tl.store(k_cache_ptr + slot * row_size + offs, tl.load(k_ptr + t * row_size + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * row_size + offs, tl.load(v_ptr + t * row_size + offs, mask=mask), mask=mask)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    T, Hkv, D = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (Hkv, D)
    if T == 0:
        return
    row = Hkv * D
    _kv_cache_write_kernel[(T,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, row,
                                 BLOCK=min(triton.next_power_of_2(row), 1024))
