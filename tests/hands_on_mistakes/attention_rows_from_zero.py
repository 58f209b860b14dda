"""Places a request's rows at positions 0 .. query_len - 1, not at the LAST query_len of its context.

A wrong solution from a student walkthrough (tests/test_hands_on_mistakes.py: WRONG)."""
from __future__ import annotations
import math
import torch
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class MyPagedAttention(AttentionBackend):
    name = "my-paged-attention"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        T = q.shape[0]
        bs = meta.block_size
        n = meta.num_tokens
        flat_k = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        flat_v = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        slots = meta.slot_mapping[:T].long()
        flat_k[slots] = k.to(flat_k.dtype)
        flat_v[slots] = v.to(flat_v.dtype)
        out = torch.zeros(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (ql, cl) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            nb = math.ceil(cl / bs)
            blocks = meta.block_tables[i, :nb].long()
            kk = kv_cache[0][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:cl].float()
            vv = kv_cache[1][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:cl].float()
            kk = kk.repeat_interleave(group, dim=1)  # (cl, H, D)
            vv = vv.repeat_interleave(group, dim=1)
            qq = q[start:start + ql].float()  # (ql, H, D)
            s = torch.einsum("qhd,khd->hqk", qq, kk) * self.scale
            qpos = torch.arange(0, ql, device=q.device)[:, None]
            kpos = torch.arange(cl, device=q.device)[None, :]
            s = s.masked_fill(kpos > qpos, float("-inf"))
            p = s.softmax(-1)
            out[start:start + ql] = torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)
            start += ql
        return out.reshape(T, self.num_heads * self.head_dim)
