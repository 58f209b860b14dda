"""The paged KV cache: its tensor layout and how big the pool is.

Layout, one tensor for the whole model:

    kv_cache: (num_full_attention_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
                            |   |
                            |   +-- physical block id (what block tables hold)
                            +------ 0 = keys, 1 = values

`kv_cache[layer]` is the (2, ...) view a layer reads and writes. A token's "slot" is
`block_id * block_size + offset`, so `kv_cache[layer, 0].view(-1, num_kv_heads, head_dim)[slot]` is
its key.

The pool reads as zeros until written: attention gathers whole blocks and masks the slots past a
sequence's end, and a masked probability of 0 times a stale NaN would still be NaN, so a never-written
slot must hold a number. On CUDA the pool is `torch.zeros`. On CPU, zero-filling 1 GiB would commit
1 GiB of RAM at start-up for a pool that a laptop session may barely use, so the pool is an anonymous
`mmap`: the kernel maps fresh pages as zeros and commits each page only when a K/V is first written
to it. An unused pool costs address space, not RAM (tested: resident memory grows by a small
fraction of the pool when an engine starts).

That first write is a page fault, and with 4 KiB pages it is slow: writing the K/V of a 2 000-token
prefill into never-used blocks took 72 ms against 1 ms into used ones (2 AMD EPYC cores, a VM), about
7 % of the fp32 throughput benchmark, which keeps reaching fresh blocks. So the pool also asks for
transparent huge pages (`MADV_HUGEPAGE`, where Linux offers it): one fault then maps 2 MiB, and the
same first write took 3-5 ms. The price is granularity: RAM is committed 2 MiB at a time per layer's
K (and V) region, so a pool that holds anything holds at least 2 x layers x 2 MiB.

Sizing (when `num_kv_blocks` is not given):
  * CUDA: `gpu_memory_utilization` x free memory after the weights, less a 10 % activation reserve
    (so 0.9 x 0.9 = 81 % of the free memory by default).
  * CPU: `cpu_kv_cache_bytes` (1 GiB by default), committed lazily as above.
"""

from __future__ import annotations

import math
import mmap

import torch

from minivllm.config import EngineConfig
from minivllm.models.hf_config import ModelSpec


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Only full-attention layers have a KV cache (a hybrid model's linear-attention layers keep a
    fixed-size state instead: engine/state_pool.py)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * len(spec.full_attention_layers) * block_size * spec.num_key_value_heads * spec.head_dim * itemsize


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
    shape = (len(spec.full_attention_layers), 2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
    return zeros(shape, dtype, device)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU an anonymous mapping, so its pages are committed only when first written,
    in 2 MiB huge pages where the kernel allows (see the module docstring)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE)  # zero-filled by the kernel; one spare huge page to align
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages, still lazily committed
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` open as long as the tensor lives
    skip = -raw.data_ptr() % _HUGE_PAGE  # start on a 2 MiB boundary so every huge page is a whole one
    return raw[skip:skip + nbytes].view(dtype).view(shape)


_HUGE_PAGE = 2 << 20
