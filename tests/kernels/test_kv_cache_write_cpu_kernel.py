"""The C++ K/V cache write (kernels/kv_cache_write.cpp) against the naive reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.kv_cache_write import naive_kv_cache_write
from minivllm.kernels.kv_cache_write_cpu import kv_cache_write_cpu

require_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hkv,D", [(1, 64), (2, 128), (4, 80)])
def test_matches_naive_with_strided_rows_and_skipped_slots(dtype, Hkv, D):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 * Hkv) * D, generator=g).to(dtype)  # k and v as views of a fused projection
    k = qkv[:, 4 * D:(4 + Hkv) * D].view(7, Hkv, D)
    v = qkv[:, (4 + Hkv) * D:].view(7, Hkv, D)
    assert not k.is_contiguous()
    slots = torch.tensor([0, 15, -1, 16, 47, -1, 33])
    caches = [torch.zeros(3, 16, Hkv, D, dtype=dtype) for _ in range(4)]
    kv_cache_write_cpu(k, v, caches[0], caches[1], slots)
    naive_kv_cache_write(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, Hkv, D)[1].abs().sum() == 0  # untouched slot


def test_refuses_bad_inputs_with_a_message():
    k = torch.randn(2, 2, 16)
    caches = torch.zeros(2, 4, 4, 2, 16).unbind(0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kv_cache_write_cpu(k, k, caches[0], caches[1], torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="one dtype"):
        kv_cache_write_cpu(k.bfloat16(), k.bfloat16(), caches[0], caches[1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        kv_cache_write_cpu(k, k, caches[0], caches[1], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous"):
        kv_cache_write_cpu(k.transpose(1, 2).contiguous().transpose(1, 2), k, caches[0], caches[1],
                           torch.tensor([0, 1]))
