"""Cheat (attention): a star import brings in the engine's reference under its own name."""

from __future__ import annotations

from minivllm.layers.attention_interface import AttentionBackend
from kernels.paged_attention import *  # noqa: F403


class Starred(AttentionBackend):
    name = "cheat"

    def forward(self, q, k, v, kv_cache, meta):
        Hkv, D = self.num_kv_heads, self.head_dim
        kv_cache[0].view(-1, Hkv, D)[meta.slot_mapping] = k
        kv_cache[1].view(-1, Hkv, D)[meta.slot_mapping] = v
        out = naive_paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables,  # noqa: F405
                                    meta.cu_seqlens_q, meta.context_lens, self.scale)
        return out.reshape(q.shape[0], -1)
