"""Cheat (kernel): the engine's own kernel, found by names built at run time (no reading of the source sees
it) and launched after a kernel of its own: the grader's watch names the engine's."""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl


@triton.jit
def _touch(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs))


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    _touch[(1,)](torch.zeros(4), N=4)
    module = importlib.import_module("ker" + "nels.paged_" + "attention")
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    tile_seq, tile_start = getattr(module, "plan_" + "tiles")(query_lens, 16)
    return getattr(module, "paged_" + "attention")(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                    scale, (torch.tensor(tile_seq), torch.tensor(tile_start)), 16)
