"""`PerRowAttentionBackend`: attention in which every row is a one-row query over its own context.

The PyTorch backend (layers/torch_attention.py) computes a prefill chunk as one SDPA call over the
chunk's queries, and decode rows as one padded call for all of them. Both are fast, and both make a
row's bits depend on its neighbours: SDPA's kernel blocks the query block and the keys by their
lengths, so a prompt computed as one chunk of 40 tokens or as chunks of 8 + 32 (because other
requests took the rest of the step's token budget) sums its scores in other orders.

In batch-invariant mode (layers/batch_invariance.py) this backend serves instead. Row r of a request
with `context_len` keys after the step and `query_len` new rows sits at position
`context_len - query_len + r` and attends to the keys 0 .. that position: a decode row does exactly
that, so every row, prefill rows too, goes through the decode path. What a row computes then depends
on its query, its keys and its length only:

  * the C++ paged decode kernel (kernels/paged_decode_attention.py) where it is built and the dtype is
    float32 or bfloat16: one task per (row, KV head), each summing over its own context in one fixed
    order, whatever the other tasks are;
  * otherwise its plain-PyTorch reference, a loop over rows (slow, the same arithmetic for every row).

Which of the two runs is fixed when the backend is built (nothing is timed), so it is the same for
every step of the engine. The price: a prefill of P tokens is P one-row queries instead of one
flash-attention call (docs/concepts/batch-invariance.md gives the measured cost).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.paged_decode_attention import naive_paged_decode_attention, paged_decode_attention
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class _RowPlan(NamedTuple):
    block_tables: torch.Tensor  # (T, max_blocks) int32: each row's request's table
    context_lens: torch.Tensor  # (T,) int64: keys row r may read (its own position + 1)


def row_layout(meta: AttentionMetadata) -> _RowPlan:
    """Every row as its own one-row request: its request's block table and its own context length."""
    device = meta.block_tables.device
    lens = []
    for q, ctx in zip(meta.query_lens, meta.context_lens_host):
        lens.extend(range(ctx - q + 1, ctx + 1))  # the request's rows see 1, 2, ... more keys
    query_lens = torch.tensor(meta.query_lens, device=device)
    tables = meta.block_tables.repeat_interleave(query_lens, dim=0).int().contiguous()  # (T, max_blocks)
    return _RowPlan(tables, torch.tensor(lens, dtype=torch.int64, device=device))


class PerRowAttentionBackend(AttentionBackend):
    """Every row through one decode path (see the module docstring); CPU, one rank, eager."""

    name = "per_row"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        build = load_cpu_kernels()
        self.uses_kernel = build.available and dtype in (torch.float32, torch.bfloat16)
        self.detail = ("minivllm's C++ paged decode kernel for every row" if self.uses_kernel else
                       f"the plain-PyTorch per-row loop (the kernel: {build.detail}, dtype {dtype})")

    def __str__(self) -> str:
        return f"attention: one-row queries over each row's own context, {self.detail} (batch_invariant=True)"

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = row_layout(meta)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        plan = meta.plan
        assert isinstance(plan, _RowPlan), "prepare(meta) must run before forward: meta.plan is not this backend's"
        T, D = q.shape[0], self.head_dim
        if T != meta.num_tokens:
            raise ValueError(f"{T} rows for {meta.num_tokens} tokens: the per-row backend runs eager steps only "
                             "(no padded, compiled steps); batch_invariant needs enforce_eager")
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, Hkv, D) each
        # The new K/V first: a prefill row's context includes the rows before it in this very step.
        k_cache.view(-1, self.num_kv_heads, D).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, D).index_copy_(0, meta.slot_mapping, v)
        attend = paged_decode_attention if self.uses_kernel else naive_paged_decode_attention
        o = attend(q.contiguous(), k_cache, v_cache, plan.block_tables, plan.context_lens, self.scale)  # (T, Hq, D)
        return o.reshape(T, self.num_heads * D)
