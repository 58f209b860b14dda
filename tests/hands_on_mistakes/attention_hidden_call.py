"""Cheat (attention): the engine's reference reached by names built at run time, which no reading of the
source sees: the grader's watch on the calls names it."""

from __future__ import annotations

import importlib

from minivllm.layers.attention_interface import AttentionBackend


class Hidden(AttentionBackend):
    name = "cheat"

    def forward(self, q, k, v, kv_cache, meta):
        Hkv, D = self.num_kv_heads, self.head_dim
        kv_cache[0].view(-1, Hkv, D)[meta.slot_mapping] = k
        kv_cache[1].view(-1, Hkv, D)[meta.slot_mapping] = v
        module = importlib.import_module("ker" + "nels.paged_" + "attention")
        reference = getattr(module, "naive_" + "paged_attention")
        out = reference(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                        self.scale)
        return out.reshape(q.shape[0], -1)
