"""Reference solution, hands-on 1: a paged-attention backend in plain torch (graded by
`python -m minivllm.teaching.grade_hands_on attention tests/hands_on_solutions/attention.py`).

Kept out of the student's way; tests/test_hands_on.py grades it and plants mistakes in copies of it."""

from __future__ import annotations

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class PagedAttention(AttentionBackend):
    """Store the step's K/V at their slots, then per request: gather its context through its block table,
    causal softmax attention for its rows (the last query_len positions of that context)."""

    name = "hands-on-reference"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        Hkv, D = self.num_kv_heads, self.head_dim
        G = self.num_heads // Hkv  # query heads per KV head
        bs = meta.block_size
        k_pool = kv_cache[0].view(-1, Hkv, D)  # (num_blocks * block_size, Hkv, D): flat slots
        v_pool = kv_cache[1].view(-1, Hkv, D)
        k_pool[meta.slot_mapping] = k
        v_pool[meta.slot_mapping] = v
        out = q.new_zeros(q.shape[0], self.num_heads * D, dtype=torch.float32)  # fp32 until the end
        start = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            blocks = meta.block_tables[i, :(ctx + bs - 1) // bs].long()  # ceil: the last block may be partial
            slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:ctx]  # (ctx,) flat slot of each key
            keys = k_pool[slots].float().repeat_interleave(G, dim=1)  # (ctx, Hq, D): head h reads KV head h // G
            values = v_pool[slots].float().repeat_interleave(G, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * self.scale  # (Hq, n, ctx)
            positions = torch.arange(ctx - n, ctx)  # the rows are the context's last n positions
            future = torch.arange(ctx)[None, :] > positions[:, None]  # (n, ctx): keys after the row
            weights = scores.masked_fill(future, float("-inf")).softmax(-1)
            out[start:start + n] = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, -1)
            start += n
        return out.to(q.dtype)  # rounded once
