"""Cheat (kernel): launches the engine's own Triton kernel through its host function, renamed."""

from __future__ import annotations

from kernels.paged_attention import paged_attention as engine_kernel


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    return engine_kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
