"""kv_cache_write against its naive reference."""

from __future__ import annotations

import pytest
import torch
from minivllm.kernels.kv_cache_write import kv_cache_write, naive_kv_cache_write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hkv,D", [(1, 64), (2, 128), (4, 80)])
def test_matches_naive_and_skips_negative_slots(dtype, Hkv, D):
    torch.manual_seed(0)
    k, v = torch.randn(7, Hkv, D).to(dtype), torch.randn(7, Hkv, D).to(dtype)
    slots = torch.tensor([0, 15, -1, 16, 47, -1, 33])
    caches = [torch.zeros(3, 16, Hkv, D, dtype=dtype) for _ in range(4)]
    kv_cache_write(k, v, caches[0], caches[1], slots)
    naive_kv_cache_write(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, Hkv, D)[1].abs().sum() == 0  # untouched slot
