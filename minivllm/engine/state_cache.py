"""`StateCache`: prefix caching for a hybrid model — snapshots of the linear-attention state, every
`stride` prompt tokens, beside the KV blocks.

Why blocks are not enough. A cached prefix lets a request skip computing it; for attention layers the
prefix's K/V blocks are all it needs. A gated-DeltaNet layer keeps no per-token past: its whole memory
of the prefix is one state (conv window + recurrent matrix) at the prefix's END. So a hit at position p
needs the KV blocks of tokens [0, p) AND the state after token p - 1. Keeping a state for every block
would cost one state (~1 MB a layer on real models) per 16 tokens; here one is kept every `stride`
tokens (a multiple of the block size and of the chunked rule's chunk), in a pool with its own budget:

    prompt       [ .......... system prompt ........... | question ]
    KV blocks    [b0][b1][b2][b3][b4][b5][b6][b7][b8][b9][b10] ...       every full block hashed
    snapshots                    ^ s(64)             ^ s(128)             key = hash of the block ending there
    a new prompt sharing 150 tokens: KV hit 144 tokens, snapshot hit at 128 -> resumes at 128

Entries. A snapshot is keyed by the chained hash of the block that ends at its position (so equal keys
mean equal whole prefixes, as for blocks) and lives in one slot of the cache's pools. Eviction is LRU
by `last_used`; a scan of the entries at commit (there are a few hundred at most).

Transactions. The cache changes in two places only:
  * admission (inside the step's transaction): a hit copies its snapshot into the request's fresh
    state slot (`load`) and marks the entry used, recorded in the step's undo log;
  * the commit (`publish`): the forward wrote the states at the step's stride positions into STAGING
    slots (never into an entry); the commit copies them into entries, evicting the least recently used.
A failed step never reaches the commit and its admission marks are rolled back: the cache is as it was.

Sizing (`resolve_state_cache`): a snapshot takes snapshot_bytes = L_linear x (conv_dim x (K-1) x dtype
bytes + Hv x Dk x Dv x 4); the budget `state_cache_bytes` holds num_slots = min(budget // snapshot_bytes,
1024) of them, of which a step's staging takes min(max_num_batched_tokens // stride + 1, num_slots // 4), and
the default stride is the smallest multiple of lcm(block_size, 64) with max_model_len / stride <=
num_slots: the snapshots of one longest prompt fit in the budget.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from minivllm.config import EngineConfig
from minivllm.engine.kv_cache import zeros
from minivllm.engine.sequence import Sequence
from minivllm.models.hf_config import ModelSpec

if TYPE_CHECKING:
    from minivllm.engine.step_types import ScheduledSequence
    from minivllm.engine.undo_log import UndoLog

CHUNK_SIZE = 64  # the chunked gated delta rule's chunk (layers/gated_deltanet.py): strides are multiples
MAX_SNAPSHOTS = 1024  # eviction scans the entries; a tiny model's budget would otherwise make millions


@dataclass(frozen=True)
class StateCacheConfig:
    stride: int  # tokens between two snapshots of a prompt
    num_snapshots: int  # entries the cache holds
    num_staging: int  # a step's snapshots before its commit (more in one step are not kept)
    snapshot_bytes: int  # one snapshot: every linear-attention layer's conv + recurrent state

    @property
    def reserved_bytes(self) -> int:
        return (self.num_snapshots + self.num_staging) * self.snapshot_bytes


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
    staging = min(config.max_num_batched_tokens // stride + 1, num_slots // 4)
    if staging < 1:
        raise ValueError(f"state_cache_bytes={budget} holds {num_slots} snapshots of {each} bytes (every linear-"
                         f"attention layer's state); prefix caching of {spec.architecture} needs at least 4: raise "
                         f"state_cache_bytes to {4 * each}, or pass enable_prefix_caching=False")
    cfg = StateCacheConfig(stride, num_slots - staging, staging, each)
    # two lines of <= 100 characters: the docs site shows this line in notebook 11 without scrolling
    print(f"minivllm: prefix caching for {spec.architecture}: a state snapshot every {stride} prompt tokens\n"
          f"  {cfg.num_snapshots} snapshots + {staging} staging of {each / 2**20:.2f} MiB = "
          f"{cfg.reserved_bytes / 2**20:.1f} MiB reserved (state_cache_bytes={budget})", file=sys.stderr)
    return cfg


class SnapshotPoint(NamedTuple):
    """A state the step keeps: row group `row`'s state after `offset` of its rows, at prompt `position`."""

    row: int
    offset: int
    position: int


def snapshot_points(scheduled: Seq[ScheduledSequence], stride: int, limit: int) -> list[SnapshotPoint]:
    """The prompt positions that are multiples of `stride` a step's chunks reach, in batch order; the
    j-th goes to staging slot j. One function for the runner (what to keep) and the commit (what it is)."""
    points = []
    for i, s in enumerate(scheduled):
        last = min(s.start + s.num_new_tokens - s.num_spec_tokens, s.seq.num_prompt_tokens)
        for p in range((s.start // stride + 1) * stride, last + 1, stride):
            points.append(SnapshotPoint(i, p - s.start, p))
    return points[:limit]


@dataclass(slots=True)
class Snapshot:
    """One entry: where it lives, its key, when it was last used (what the undo log records)."""

    slot: int
    key: bytes
    last_used: int


class StateCache:
    def __init__(self, cfg: StateCacheConfig, spec: ModelSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        la, n = spec.linear_attn, cfg.num_snapshots + cfg.num_staging  # staging: the last num_staging slots
        self.cfg, self.stride, self.block_size = cfg, cfg.stride, block_size
        self.conv_pools = [zeros((n, *la.conv_state_shape), dtype, device) for _ in spec.linear_attention_layers]
        self.recurrent_pools = [zeros((n, *la.recurrent_state_shape), torch.float32, device)
                                for _ in spec.linear_attention_layers]  # (S, Hv, Dk, Dv) each
        self.entries: dict[bytes, Snapshot] = {}
        self.free: list[int] = list(range(cfg.num_snapshots - 1, -1, -1))
        self.clock = 0
        self.num_hits = 0  # requests that resumed from a snapshot
        self.num_evictions = 0

    # --- admission (inside the step's transaction) ----------------------------------------------
    def hit_tokens(self, hashes: list[bytes], num_kv_tokens: int) -> int:
        """The longest cached prefix with both its KV blocks (`num_kv_tokens`) and a snapshot at its end."""
        for p in range(num_kv_tokens // self.stride * self.stride, 0, -self.stride):
            if hashes[p // self.block_size - 1] in self.entries:
                return p
        return 0

    def load(self, seq: Sequence, conv_pools: list[torch.Tensor], recurrent_pools: list[torch.Tensor], dst: int,
             undo: UndoLog | None) -> None:
        """Copy the snapshot at `seq`'s prefix hit into slot `dst` of the state pool's tensors."""
        entry = self.entries[seq.block_hashes[seq.num_computed_tokens // self.block_size - 1]]
        if undo is not None:
            undo.record_attr(entry, "last_used")
            for name in ("clock", "num_hits"):
                undo.record_attr(self, name)
        self.clock += 1
        entry.last_used, self.num_hits = self.clock, self.num_hits + 1
        for pool, snaps in zip((*conv_pools, *recurrent_pools), (*self.conv_pools, *self.recurrent_pools)):
            pool[dst] = snaps[entry.slot]

    # --- the commit ------------------------------------------------------------------------------
    def staging_slots(self, num: int) -> list[int]:
        return list(range(self.cfg.num_snapshots, self.cfg.num_snapshots + num))

    def step_snapshots(self, scheduled: Seq[ScheduledSequence]) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
        """For the runner: per row group, the row counts after which its state is kept; their staging slots."""
        points = snapshot_points(scheduled, self.stride, self.cfg.num_staging)
        offsets = tuple(tuple(p.offset for p in points if p.row == i) for i in range(len(scheduled)))
        return offsets, self.staging_slots(len(points))

    def publish(self, scheduled: Seq[ScheduledSequence]) -> None:
        """The step succeeded: its staged snapshots become entries (an equal key already cached stays)."""
        points = snapshot_points(scheduled, self.stride, self.cfg.num_staging)
        for staged, (row, _, position) in zip(self.staging_slots(len(points)), points):
            hashes = scheduled[row].seq.block_hashes
            if len(hashes) < position // self.block_size:  # its blocks were never hashed (it finished first)
                continue
            key = hashes[position // self.block_size - 1]
            self.clock += 1
            if key in self.entries:
                self.entries[key].last_used = self.clock
                continue
            slot = self.free.pop() if self.free else self._evict()
            for pool in (*self.conv_pools, *self.recurrent_pools):
                pool[slot] = pool[staged]
            self.entries[key] = Snapshot(slot, key, self.clock)

    def _evict(self) -> int:
        victim = min(self.entries.values(), key=lambda e: e.last_used)
        del self.entries[victim.key]
        self.num_evictions += 1
        return victim.slot

    # --- proof ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every slot is free or holds exactly one entry; entries are findable under their own key."""
        held = [e.slot for e in self.entries.values()]
        assert len(set(held)) == len(held), "two snapshots share a slot"
        assert not set(held) & set(self.free) and len(set(self.free)) == len(self.free), "a slot is free and held"
        assert sorted(held + self.free) == list(range(self.cfg.num_snapshots)), "a snapshot slot is lost"
        assert all(k == e.key for k, e in self.entries.items())
