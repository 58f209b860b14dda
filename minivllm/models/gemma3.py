"""Gemma 3's text decoder: sliding-window layers beside full-attention ones, on a flat varlen batch.

    input_ids (T,) -> embed * sqrt(hidden)
      -> [ norm -> attention -> norm -> +residual -> norm -> GELU-tanh MLP -> norm -> +residual ] x L
      -> norm -> hidden (T, H);  logits = hidden @ embed^T (tied) for the sampled rows

What differs from Llama (models/llama.py), each a switch of HF's Gemma3TextModel:
  * every RMSNorm scales by (1 + w) (`ZeroCenteredRMSNorm`, as Qwen3.5's), four per layer: before and
    after attention, before and after the MLP (the "sandwich");
  * per-head q and k norms before RoPE; q scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
    (the backend scales by head_dim ** -0.5, so q is multiplied by the ratio first);
  * the embedding is multiplied by sqrt(hidden_size) (in the model's dtype, as HF rounds it);
  * the MLP's activation is GELU with the tanh approximation;
  * layer i is `spec.layer_types[i]`: "sliding_attention" layers see the last `sliding_window` keys
    and rotate with the local RoPE base (10k); "full_attention" layers see everything and rotate with
    the global base (1M), with the checkpoint's RoPE scaling.
The two kinds keep their K/V in different pools (engine/core/kv_cache_groups.py), so a sliding layer reads
`meta.sliding`: its group's slots and block tables, and the window.

No real Gemma checkpoint is reachable offline: the tests run tiny random configs against HF transformers.
`Gemma3ForConditionalGeneration` checkpoints load their text decoder only (models/loader.py skips the
vision tower). One rank only (models/sharding.py), eager only (`supports_compile` False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.linear import Linear
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata
from minivllm.layers.norm_variants import ZeroCenteredRMSNorm
from minivllm.layers.parallel_linear import VocabParallelEmbedding
from minivllm.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.models.lm_head import LMHeadMixin


class Gemma3Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(spec.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)
        # the backend multiplies scores by head_dim ** -0.5; Gemma wants query_pre_attn_scalar ** -0.5
        self.q_scale = (spec.head_dim / spec.query_pre_attn_scalar) ** 0.5

    def project(self, rope: RopeTables, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> q (T, Hq, D), k and v (T, Hkv, D): normed per head, rotated, q rescaled."""
        s = self.spec
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = self.q_norm(q.view(T, s.num_attention_heads, s.head_dim))  # (T, Hq, D)
        k = self.k_norm(k.view(T, s.num_key_value_heads, s.head_dim))  # (T, Hkv, D)
        q, k = apply_rotary(q, k, rope)
        return q * self.q_scale, k, v.view(T, s.num_key_value_heads, s.head_dim)

    def forward(self, rope: RopeTables, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """x (T, hidden) -> o_proj(attention over this layer's cache) (T, hidden)."""
        o = backend.forward(*self.project(rope, x), kv_cache, meta)  # (T, Hq*D)
        return self.o_proj(o)


class Gemma3MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_type: str) -> None:
        super().__init__()
        self.is_sliding = layer_type == "sliding_attention"
        self.self_attn = Gemma3Attention(spec)
        self.mlp = Gemma3MLP(spec)
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(H, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(H, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(H, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(H, eps)

    def forward(self, rope: RopeTables, h: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """h (T, hidden), the residual stream -> the stream after this layer (T, hidden). `rope` and `meta`
        are this layer's kind's: local tables and the sliding group's metadata on a sliding layer."""
        h = h + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(h), kv_cache, meta, backend))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, 0, ParallelContext())
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, t) for t in spec.layer_types)
        self.norm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Gemma3ForCausalLM(LMHeadMixin, CausalLM):
    """Also the text decoder of Gemma3ForConditionalGeneration."""

    eager_reason = "compile_forward is written for the Llama decoder (models/llama.py), not for Gemma 3's layers"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        if spec.local_rope is None or spec.query_pre_attn_scalar is None:
            raise ValueError(f"{spec.architecture} is not a Gemma 3 checkpoint: no local RoPE / query_pre_attn_scalar")
        self.model = Gemma3Model(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # global layers' tables, built by `init_rotary`
        self.local_rotary: RotaryEmbedding | None = None  # sliding layers' tables

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.spec.head_dim, max_position, self.spec.rope, device)
        self.local_rotary = RotaryEmbedding(self.spec.head_dim, max_position, self.spec.local_rope, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer: (2, num_blocks of its group's pool, block_size, Hkv, D)
        backend: AttentionBackend,
        linear_attn: LinearAttnMetadata | None = None,  # no linear-attention layers: always None
    ) -> torch.Tensor:  # (T, hidden)
        # sliding layers read their group's metadata (none when `layer_types` makes every layer full)
        assert meta.sliding is not None or self.spec.sliding_window is None, "sliding layers need meta.sliding"
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        h = h * torch.tensor(self.spec.hidden_size ** 0.5, dtype=h.dtype)  # HF rounds the factor to the dtype
        global_rope = self.rotary.lookup(positions, h.dtype)  # once per step, shared by the layers of a kind
        local_rope = self.local_rotary.lookup(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            rope, layer_meta = (local_rope, meta.sliding) if layer.is_sliding else (global_rope, meta)
            h = layer(rope, h, kv_caches[i], layer_meta, backend)
        return self.model.norm(h)
