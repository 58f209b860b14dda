"""The paged KV cache: its tensor layout and how big the pool is.

Layout, one tensor for the whole model:

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
                            |   |
                            |   +-- physical block id (what block tables hold)
                            +------ 0 = keys, 1 = values

`kv_cache[layer]` is the (2, ...) view a layer reads and writes. A token's "slot" is
`block_id * block_size + offset`, so `kv_cache[layer, 0].view(-1, num_kv_heads, head_dim)[slot]` is
its key. The pool is zero-filled: masked padding then multiplies zeros, never stale NaNs.

Sizing (when `num_kv_blocks` is not given):
  * CUDA: `gpu_memory_utilization` x free memory after the weights, less a 10 % activation reserve.
  * CPU: `cpu_kv_cache_bytes` (1 GiB by default).
"""

from __future__ import annotations

import torch

from minivllm.config import EngineConfig
from minivllm.models.hf_config import ModelSpec


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_hidden_layers * block_size * spec.num_key_value_heads * spec.head_dim * itemsize


def num_kv_blocks_for(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(spec, config.block_size, dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization * 0.9)
    else:
        budget = config.cpu_kv_cache_bytes
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                         "raise cpu_kv_cache_bytes / gpu_memory_utilization or set num_kv_blocks")
    return blocks


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    shape = (spec.num_hidden_layers, 2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
