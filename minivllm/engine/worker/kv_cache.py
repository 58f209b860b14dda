"""The paged KV cache: its tensor layout and how big the pool is.

Layout, one tensor for the whole model:

    kv_cache: (num_full_attention_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
                            |   |
                            |   +-- physical block id (what block tables hold)
                            +------ 0 = keys, 1 = values

A model with sliding-window layers (Gemma 3) has a second tensor of the same layout for them, with
its own block ids (`num_sliding_blocks`): one pool per KV-cache group (engine/core/kv_cache_groups.py).

`kv_cache[layer]` is the (2, ...) view a layer reads and writes. A token's "slot" is
`block_id * block_size + offset`, so `kv_cache[layer, 0].view(-1, num_kv_heads, head_dim)[slot]` is
its key.

The pool reads as zeros until written: attention gathers whole blocks and masks the slots past a
sequence's end, and a masked probability of 0 times a stale NaN would still be NaN, so a never-written
slot must hold a number. On CUDA the pool is `torch.zeros`. On CPU, zero-filling 1 GiB would commit
1 GiB of RAM at start-up for a pool that a laptop session may barely use, so the pool is an anonymous
private `mmap`: the kernel maps fresh pages as zeros and commits each (4 KiB) page only when a K/V is
first written to it. An unused pool costs address space, not RAM (tested: resident memory grows by a
small fraction of the pool when an engine starts). Not numpy's `zeros` (calloc), which advises the
kernel to back large arrays with 2 MiB huge pages: with Linux's usual `defrag=madvise`, the first write
to each layer's K or V then waits for the kernel to compact and zero a huge page, 11-18 ms a write on a busy
Zen 4 host, 0.5 s of the first step of a 30-layer model (measured; tested: the pool is not so advised).

Sizing (when `num_kv_blocks` is not given):
  * CUDA: `gpu_memory_utilization` x free memory after the weights, less a 10 % activation reserve
    (so 0.9 x 0.9 = 81 % of the free memory by default).
  * CPU: `cpu_kv_cache_bytes` (1 GiB by default), committed lazily as above.
  With sliding-window layers, their pool is sized first (`sliding_pool_blocks`: enough for every running
  request's window, but at most half the budget and never more blocks than the full pool) and the
  full-attention pool gets the rest.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.models.hf_config import ModelSpec


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """A block of the full-attention layers (or of `num_layers` layers). A hybrid model's linear-attention
    layers keep a fixed-size state instead (engine/core/state_pool.py)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = len(spec.full_attention_layers) if num_layers is None else num_layers
    return 2 * layers * block_size * spec.num_key_value_heads * spec.head_dim * itemsize


def sliding_pool_blocks(sliding_window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks enough for the sliding group never to be what stops admission: each running request
    holds ceil(W/B) + 1 blocks after a decode, one more while a step's token crosses into a new block,
    and a step's new tokens take at most ceil(budget / B) + max_num_seqs blocks beyond that. (What a
    request holds is the scheduler's books' rule, engine/core/sliding_window.py; the count lives here, with
    the pools it sizes, so the runner's side imports nothing of the scheduler's.)"""
    per_request = -(-sliding_window // block_size) + 2
    return max_num_seqs * (per_request + 1) + -(-max_num_batched_tokens // block_size)


class KVPoolSizes(NamedTuple):
    num_blocks: int  # the full-attention pool
    num_sliding_blocks: int = 0  # the sliding-window layers' pool (0: no such layers)


def num_kv_blocks_for(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> KVPoolSizes:
    """Both pools' blocks. The sliding pool: windows for max_num_seqs requests (`sliding_pool_blocks`), but
    never more blocks than the full pool (a request never holds more sliding blocks than full ones) nor more
    memory (past that the full pool stops admission first, and the extra windows would idle)."""
    bound = 0 if spec.sliding_window is None else sliding_pool_blocks(
        spec.sliding_window, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
    if config.num_kv_blocks is not None:
        return KVPoolSizes(config.num_kv_blocks, min(bound, config.num_kv_blocks))
    per_block = kv_block_bytes(spec, config.block_size, dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization * 0.9)
    else:
        budget = config.cpu_kv_cache_bytes
    sliding = 0
    if bound:  # the sliding pool first: its need is bounded
        per_sliding = kv_block_bytes(spec, config.block_size, dtype, len(spec.sliding_attention_layers))
        sliding = min(bound, budget // (2 * per_sliding), budget // (per_sliding + per_block))
        budget -= sliding * per_sliding
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                         "raise cpu_kv_cache_bytes / gpu_memory_utilization or set num_kv_blocks")
    return KVPoolSizes(blocks, min(sliding, blocks))


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, num_layers: int | None = None) -> torch.Tensor:
    """The full-attention layers' pool (or one of `num_layers` layers: the sliding-window group's)."""
    layers = len(spec.full_attention_layers) if num_layers is None else num_layers
    shape = (layers, 2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
    return zeros(shape, dtype, device)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU an anonymous private mapping, so its pages are committed only when first
    written, a page at a time (see the module docstring). The buffer is raw bytes viewed in `dtype`; the
    tensor holds the mapping alive (`torch.frombuffer` keeps a reference to it)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows has no private anonymous mmap: calloc
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    # MAP_PRIVATE: a forked child gets its own copy-on-write pool, never a shared one (mmap's default).
    raw = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    return raw.view(dtype).view(shape)
