"""`kv_cache_write_cpu`: the K/V cache write on CPU, as minivllm's C++ kernel (kv_cache_write.cpp).

The same operation as the Triton kernel in kv_cache_write.py (whose docstring draws it), for the PyTorch
attention backend on CPU: each new token's key and value rows are copied to their slots. PyTorch's
`index_copy_` does the same but costs ~35 µs a call at these sizes, twice a layer: about 6 % of a bf16
decode step of the `minivllm bench` model on 2 cores. The C++ loop is one memcpy a row.

Its reference is `kv_cache_write.naive_kv_cache_write`; tests/kernels compare them. This module imports
no Triton, so the PyTorch backend can use it where Triton is not installed.
"""

from __future__ import annotations

import torch


def kv_cache_write_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: (T, Hkv, D), each row's Hkv * D values contiguous; caches: (num_blocks, block_size, Hkv, D),
    contiguous, k's dtype; slot_mapping: (T,) int64, -1 = skip. Call `load_cpu_kernels()` first."""
    torch.ops.minivllm_cpu.kv_cache_write(k, v, k_cache, v_cache, slot_mapping)
