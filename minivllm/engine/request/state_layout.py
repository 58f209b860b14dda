"""The layout of a hybrid model's state memory, shared by the scheduler's books and the runner's tensors.

Two pools hold a hybrid model's linear-attention states (conv window + recurrent matrix, per layer):

    state pool      (2 + d) x P slots       P pairs (one per running request) then d candidates per pair
                                            (speculative decoding): engine/core/state_pool.py keeps the books
    snapshot pool   S slots                 prefix caching's snapshots: engine/core/state_cache.py keeps the books

The scheduler side decides slot numbers (integers); the runner side (engine/worker/state_tensors.py) owns the
tensors and is told, row by row, which slots to read, write and copy (`StateRow`, engine/request/step_types.py).
This module is what both sides agree on: the sizes, and where the slots of pair p are.

    pair p           slots 2p and 2p + 1: one holds the published state, the other is staging
    candidate j of p slot 2P + p*d + j - 1 (1 <= j <= d): the state after j rows of a verification

Sizing the snapshot pool (`resolve_state_cache`): a snapshot takes snapshot_bytes = L_linear x (conv_dim x
(K-1) x dtype bytes + Hv x Dk x Dv x 4); the budget `state_cache_bytes` holds num_snapshots =
min(budget // snapshot_bytes, 1024) of them; a step keeps at most max_per_step = min(max_num_batched_tokens
// stride + 1, num_snapshots // 4); the default stride is the smallest multiple of lcm(block_size, 64) with
max_model_len / stride <= num_snapshots: the snapshots of one longest prompt fit in the budget.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig
from minivllm.models.hf_config import ModelSpec

CHUNK_SIZE = 64  # the chunked gated delta rule's chunk (layers/gated_deltanet.py): strides are multiples
MAX_SNAPSHOTS = 1024  # eviction scans the entries; a tiny model's budget would otherwise make millions


@dataclass(frozen=True)
class StateCacheConfig:
    stride: int  # tokens between two snapshots of a prompt
    num_snapshots: int  # the snapshot pool's slots: entries, and a step's max_per_step kept free
    max_per_step: int  # a step's snapshots (more in one step are not kept)
    snapshot_bytes: int  # one snapshot: every linear-attention layer's conv + recurrent state

    @property
    def reserved_bytes(self) -> int:
        return self.num_snapshots * self.snapshot_bytes


def snapshot_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    la = spec.linear_attn
    conv = math.prod(la.conv_state_shape) * torch.empty((), dtype=dtype).element_size()
    return len(spec.linear_attention_layers) * (conv + math.prod(la.recurrent_state_shape) * 4)


def resolve_state_cache(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> StateCacheConfig:
    """The state cache a hybrid model with prefix caching gets (the formula of the module docstring), with a
    line on stderr saying what it reserves. A budget of fewer than 4 snapshots is refused."""
    each = snapshot_bytes(spec, dtype)
    budget = config.state_cache_bytes
    num_slots = min(budget // each, MAX_SNAPSHOTS)
    align = math.lcm(config.block_size, CHUNK_SIZE)
    stride = config.state_cache_stride
    if stride is None:  # the smallest aligned stride whose snapshots of one longest prompt fit
        stride = align * max(1, -(-config.max_model_len // (align * max(num_slots, 1))))
    per_step = min(config.max_num_batched_tokens // stride + 1, num_slots // 4)
    if per_step < 1:
        raise ValueError(f"state_cache_bytes={budget} holds {num_slots} snapshots of {each} bytes (every linear-"
                         f"attention layer's state); prefix caching of {spec.architecture} needs at least 4: raise "
                         f"state_cache_bytes to {4 * each}, or pass enable_prefix_caching=False")
    cfg = StateCacheConfig(stride, num_slots, per_step, each)
    # two lines of <= 100 characters: the docs site shows this line in notebook 11 without scrolling
    print(f"minivllm: prefix caching for {spec.architecture}: a state snapshot every {stride} prompt tokens\n"
          f"  {cfg.num_snapshots} snapshots of {each / 2**20:.2f} MiB = "
          f"{cfg.reserved_bytes / 2**20:.1f} MiB reserved (state_cache_bytes={budget})", file=sys.stderr)
    return cfg


def pair_slots(pair: int) -> tuple[int, int]:
    """The two physical slots of state pair `pair`."""
    return 2 * pair, 2 * pair + 1


def candidate_slot(num_pairs: int, num_speculative_tokens: int, pair: int, num_rows: int) -> int:
    """Where a verification keeps pair `pair`'s state after its first `num_rows` rows (1 .. d)."""
    return 2 * num_pairs + pair * num_speculative_tokens + num_rows - 1
