"""Random paged-KV batches for the kernel tests."""

from __future__ import annotations

import os
import random

import pytest
import torch
from minivllm.kernels.cpu_build import load_cpu_kernels


def require_cpu_kernels() -> None:
    """Skip the calling test module (with the reason) where minivllm's C++ CPU kernels cannot be built
    here; CI has a compiler and ninja, so there a failed build fails instead."""
    build = load_cpu_kernels()
    if not build.available:
        assert not os.environ.get("CI"), f"CI must build the CPU kernels: {build.detail}"
        pytest.skip(build.detail, allow_module_level=True)


def make_batch(query_lens, context_lens, Hq, Hkv, D, block_size, dtype, seed=0):
    """Random paged caches and a batch whose request i has context_lens[i] tokens, the last
    query_lens[i] of them queried now (the earlier ones are a cached prefix / earlier chunks)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # scattered physical blocks
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used:used + n] + [0] * (width - n))
        used += n
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), Hq, D, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    tables_t = torch.tensor(tables, dtype=torch.int32)
    return q, k_cache, v_cache, tables_t, cu, torch.tensor(context_lens, dtype=torch.int32)
