"""Qwen3.5: a hybrid decoder, three gated-DeltaNet layers to one full-attention layer, on a flat varlen batch.

    input_ids (T,) -> embed -> [ norm -> token mixer -> +residual -> norm -> MLP -> +residual ] x L -> norm
    token mixer of layer i:  spec.layer_types[i] == "linear_attention" -> GatedDeltaNet   (a state slot)
                             spec.layer_types[i] == "full_attention"   -> GatedAttention  (paged KV cache)

What differs from Qwen3 (models/llama.py), all checked against HF transformers' Qwen3_5ForCausalLM:
  * linear attention (`GatedDeltaNet`): in_proj_qkv -> causal depthwise conv (kernel 4) + SiLU -> q, k, v;
    L2-normalised q/k; beta = sigmoid(in_proj_b x); decay g = -exp(A_log) * softplus(in_proj_a x + dt_bias);
    the gated delta rule (layers/gated_deltanet.py); a per-head RMSNorm gated by silu(in_proj_z x); out_proj.
  * full attention (`GatedAttention`): q_proj yields [q_h | gate_h] per head and the output is
    attention * sigmoid(gate) before o_proj; RoPE rotates only the first rotary_dim = head_dim / 4 dims.
  * every RMSNorm (layer norms, final norm, q/k norms) scales by (1 + w): `ZeroCenteredRMSNorm`.
The MLP is Llama's (reused from models/llama.py). Parameter names are the checkpoint's.

State: full-attention layers read and write the paged KV cache exactly like Llama. Linear-attention
layers read their starting state through `LinearAttnMetadata` and write their new states only into
the staging slots it names, never into a slot they read (see layers/linear_attn_metadata.py):
`forward` returns the hidden states, as every family's does (models/interface.py); the engine
publishes the staging slots at commit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.gated_deltanet import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, l2norm,
                                            recurrent_gated_delta_rule)
from minivllm.layers.linear import Linear
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata, LinearAttnState
from minivllm.layers.norm_variants import GatedRMSNorm, ZeroCenteredRMSNorm
from minivllm.layers.parallel_linear import VocabParallelEmbedding
from minivllm.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.models.lm_head import LMHeadMixin
from minivllm.models.llama import MLP


def text_weight_name(name: str) -> str | None:
    """This model's name for a checkpoint tensor, or None for one it does not use. Qwen3.5 is published as
    `Qwen3_5ForConditionalGeneration`, whose decoder lives under model.language_model (HF maps it the
    same way when it loads such a checkpoint into its Qwen3_5ForCausalLM):
        model.language_model.X -> model.X      lm_head.weight -> lm_head.weight
        model.visual.*  (the vision tower)     mtp.*  (the multi-token-prediction head)  -> skipped
    Gemma3ForConditionalGeneration the same way (transformers 5), or as transformers 4 saved it:
        language_model.model.X -> model.X      language_model.lm_head.weight -> lm_head.weight
        (model.)vision_tower.*, (model.)multi_modal_projector.*  -> skipped"""
    if name.startswith(("model.visual.", "mtp.", "model.vision_tower.", "model.multi_modal_projector.",
                        "vision_tower.", "multi_modal_projector.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("language_model."):
        return name.removeprefix("language_model.")
    return name


class GatedAttention(nn.Module):
    """Qwen3's attention (GQA, per-head q/k norms, paged KV) plus an output gate and partial RoPE."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        # packed like llama.py's: q_proj (with its gate rows) | k_proj | v_proj
        self.qkv_proj = Linear(spec.hidden_size, spec.q_proj_size + 2 * spec.kv_size, spec.attention_bias)
        self.o_proj = Linear(spec.q_size, spec.hidden_size, spec.attention_bias)  # HF: o_proj has the bias too
        self.q_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, cos_sin: RopeTables, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        s = self.spec
        T, H, D, r = x.shape[0], s.num_attention_heads, s.head_dim, s.rotary_dim
        q_gate, k, v = self.qkv_proj(x).split([s.q_proj_size, s.kv_size, s.kv_size], dim=-1)
        q, gate = q_gate.view(T, H, 2 * D).chunk(2, dim=-1)  # (T, H, D) each: the rows interleave per head
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, s.num_key_value_heads, D))  # (T, Hkv, D)
        q_rot, k_rot = apply_rotary(q[..., :r], k[..., :r], cos_sin)  # the other D - r dims carry no position
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        o = backend.forward(q, k, v.view(T, s.num_key_value_heads, D), kv_cache, meta)  # (T, H*D)
        return self.o_proj(o * torch.sigmoid(gate.reshape(T, H * D)))


class GatedDeltaNet(nn.Module):
    """Linear attention: a short causal conv, then the gated delta rule over each request's carried state."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        la = self.la = spec.linear_attn
        self.in_proj_qkv = Linear(spec.hidden_size, la.conv_dim, False)
        self.in_proj_z = Linear(spec.hidden_size, la.value_dim, False)  # the output gate
        self.in_proj_b = Linear(spec.hidden_size, la.num_v_heads, False)  # -> beta, the write strength
        self.in_proj_a = Linear(spec.hidden_size, la.num_v_heads, False)  # -> g, the decay
        # Only its weight (conv_dim, 1, K) is used, by our causal conv functions (they carry a window).
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel_size, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_v_heads))  # decay rate per head, in log space
        self.norm = GatedRMSNorm(la.head_v_dim, spec.rms_norm_eps)
        self.out_proj = Linear(la.value_dim, spec.hidden_size, False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearAttnState,
                snapshot_offsets: list[list[int]] | None = None
                ) -> tuple[torch.Tensor, LinearAttnState, LinearAttnState | None]:
        """(T, hidden) -> (T, hidden), the new state, and the states after `snapshot_offsets` (K of them,
        request by request; None when none is asked)."""
        la, T = self.la, x.shape[0]
        cu_seqlens = [0]
        for n in meta.query_lens:  # the same row groups as attention's
            cu_seqlens.append(cu_seqlens[-1] + n)
        starts = [c - n for c, n in zip(meta.context_lens_host, meta.query_lens)]  # each request's first position
        offsets = snapshot_offsets if snapshot_offsets and any(snapshot_offsets) else None
        conv_snaps: list[torch.Tensor] = []
        rec_snaps: list[torch.Tensor] = []
        weight = self.conv1d.weight[:, 0]  # (conv_dim, K)
        decode = all(n == 1 for n in meta.query_lens)  # one token per request: vectorised single steps
        if decode:
            mixed, conv_state = causal_conv1d_update(self.in_proj_qkv(x), weight, state.conv)  # (T, conv_dim)
        else:
            mixed, conv_state = causal_conv1d(self.in_proj_qkv(x), weight, state.conv, cu_seqlens, offsets, conv_snaps)
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = l2norm(q.reshape(T, la.num_k_heads, la.head_k_dim).float())  # (T, Hk, Dk)
        k = l2norm(k.reshape(T, la.num_k_heads, la.head_k_dim).float())
        v = v.reshape(T, la.num_v_heads, la.head_v_dim)  # (T, Hv, Dv)
        beta = self.in_proj_b(x).sigmoid()  # (T, Hv)
        # g <= 0: the state is multiplied by exp(g) each token (float32: exp(A_log) overflows fp16)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # (T, Hv)
        if decode:
            o, recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, state.recurrent, cu_seqlens)
        else:  # (T, Hv, Dv), (B, Hv, Dk, Dv)
            o, recurrent = chunk_gated_delta_rule(q, k, v, g, beta, state.recurrent, cu_seqlens, starts=starts,
                                                  snapshot_offsets=offsets, snapshots=rec_snaps)
        o = self.norm(o, self.in_proj_z(x).view(T, la.num_v_heads, la.head_v_dim))  # per head, gated
        new_state = LinearAttnState(conv_state.to(state.conv.dtype), recurrent.to(state.recurrent.dtype))
        snaps = None
        if offsets is not None and decode:  # a one-row chunk's only offset is 1: its state after the step
            rows = [i for i, offs in enumerate(offsets) if offs]
            snaps = LinearAttnState(new_state.conv[rows], new_state.recurrent[rows])
        elif offsets is not None:
            snaps = LinearAttnState(torch.stack(conv_snaps), torch.stack(rec_snaps))
        return self.out_proj(o.reshape(T, la.value_dim)), new_state, snaps


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_type: str, cache_index: int) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        # its place among the layers of its kind: which state pools (linear) or which KV cache (full) it owns
        self.cache_index = cache_index
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec)
        else:
            self.self_attn = GatedAttention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, cos_sin: RopeTables, h: torch.Tensor, kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                backend: AttentionBackend, state: LinearAttnMetadata) -> torch.Tensor:
        """h (T, hidden), the residual stream -> the stream after this layer (T, hidden). A full-attention
        layer reads and writes `kv_cache` (its own); a linear one reads its states through `state` and
        writes the new ones into the staging slots it names (None for a linear layer's `kv_cache`)."""
        x = self.input_layernorm(h)
        if self.is_linear:
            x, new_state, snaps = self.linear_attn(x, meta, state.initial_state(self.cache_index),
                                                   state.snapshot_offsets)
            state.store(self.cache_index, new_state)  # into the staging slots, if the engine gave them
            if snaps is not None:  # prefix caching: the states at the stride's positions
                state.store_snapshots(self.cache_index, snaps)
        else:
            x = self.self_attn(cos_sin, x, kv_cache, meta, backend)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, 0, ParallelContext())
        kinds = spec.layer_types
        self.layers = nn.ModuleList(DecoderLayer(spec, t, kinds[:i].count(t)) for i, t in enumerate(kinds))
        self.norm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen3_5ForCausalLM(LMHeadMixin, CausalLM):
    """The text decoder of Qwen3.5 checkpoints (`Qwen3_5ForCausalLM`, and the `model.language_model`
    part of `Qwen3_5ForConditionalGeneration`). Eager only: its linear-attention layers are not compiled."""

    needs_state_pool = True
    eager_reason = "its linear-attention layers run eagerly"

    def __init__(self, spec: ModelSpec) -> None:
        if spec.linear_attn is None or not spec.layer_types:
            raise ValueError(f"{spec.architecture} is not a hybrid checkpoint: no layer_types / linear_* keys")
        super().__init__(spec)
        self.model = DecoderModel(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False)
        self.rotary: RotaryEmbedding | None = None  # built on the right device by `init_rotary`

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        # Only the first rotary_dim dims rotate, with frequencies theta^(-2i / rotary_dim), as in HF.
        self.rotary = RotaryEmbedding(self.spec.rotary_dim, max_position, self.spec.rope, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per FULL-attention layer: (2, num_blocks, block_size, Hkv, D)
        backend: AttentionBackend,
        linear_attn: LinearAttnMetadata | None = None,  # slots and pools of the linear-attention layers
    ) -> torch.Tensor:  # (T, hidden); the new states are in the staging slots `linear_attn` names
        if linear_attn is None:
            raise ValueError(f"{type(self).__name__} has linear-attention layers: its forward needs their state "
                             "slots (linear_attn), which the engine's state pool provides")
        h = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, h.dtype)  # once per step, shared by all attention layers
        for layer in self.model.layers:
            kv_cache = None if layer.is_linear else kv_caches[layer.cache_index]
            h = layer(cos_sin, h, kv_cache, meta, backend, linear_attn)
        return self.model.norm(h)
