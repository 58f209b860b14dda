"""Hands-on 1: paged attention in plain torch, as an attention backend the engine runs.

You write `forward`, the attention of every layer of the model, for one step's flat batch (here in
blocks of 4 slots; the grader also uses other block sizes and head sizes, so read both, never assume them):

    tokens       [ a0 a1 a2 a3 | b0 | c0 c1 ]          T = 7 rows, 3 requests
    cu_seqlens_q [0,            4,   5,     7]          request i owns rows cu[i]:cu[i+1]
    context_lens [4,            9,   6]                 its K/V length after this step (cached + new)
    block_tables [[3, 8, 0], [1, 5, 6], [2, 4, 0]]      its physical blocks, padded with 0
    slot_mapping [12 13 14 15 | 24 | 16 17]             where each row's new k/v goes (block * 4 + offset)

  1. store: write each row's k and v into the pool at its slot (kv_cache[0] keys, kv_cache[1] values);
  2. attend: for each request, gather its context's keys and values through its block table, and give
     each of its rows softmax(q · kᵀ × scale) · v over the keys it may see.

What to get right (the grader's probes check them one at a time, in this order):
  * grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads);
  * a context of n keys spans ceil(n / block_size) blocks; the last may be partly filled, and the slots
    after the context hold someone else's K/V;
  * the blocks are anywhere in the pool: position p is in block_tables[i][p // block_size];
  * causality;
  * a request's rows are the LAST query_len positions of its context (decode, a chunk of a long
    prompt, or the rest of a prompt after a cached prefix: all the same case).
Read minivllm/layers/attention_interface.py (the seam) first; `self.num_heads`, `self.num_kv_heads`,
`self.head_dim` and `self.scale` are set for you. q, k and v arrive as strided views. Plain loops over
the requests are fine: correctness first (the engine's own backend, layers/torch_attention.py, shows
the fast way afterwards).

Grade:  python -m minivllm.teaching.grade_hands_on attention exercises/hands_on/1_attention/my_attention.py
        (1: the probes against naive_paged_attention; 2: the engine runs your backend on tiny Llama and
        Qwen3 models and its greedy tokens and logprobs must equal HF transformers'. --no-engine: 1 only)
Use:    LLM(model, attention_backend=MyPagedAttention(num_heads, num_kv_heads, head_dim))
"""

from __future__ import annotations

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class MyPagedAttention(AttentionBackend):
    name = "my-paged-attention"

    def forward(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, num_heads * head_dim)
        """Store this step's k/v at `meta.slot_mapping`, then return each row's attention over its request's
        context (`meta.query_lens`, `meta.context_lens_host`, `meta.block_tables`, `meta.block_size`)."""
        raise NotImplementedError
