"""The decoder shared by Llama, Qwen2 and Qwen3, written for a flat varlen batch.

    input_ids (T,) -> embed -> [ RMSNorm -> attention -> +residual -> RMSNorm -> MLP -> +residual ] x L
                   -> RMSNorm -> hidden (T, H);   logits only for the rows that are sampled

The three families differ in two switches read from config.json (see `ModelSpec`):
  * Qwen2: bias on the q/k/v projections (`attention_bias`); a Llama or Qwen3 config with
    `attention_bias: true` has it on q/k/v and on o_proj (`o_proj_bias`);
  * Qwen3: RMSNorm over each head of q and k before RoPE (`qk_norm`).
Weights are packed as vLLM packs them: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj`
(one matmul instead of three or two); the loader slices the checkpoint's tensors into them.
The residual stream travels beside the hidden state, as in vLLM: each residual add happens inside the
next RMSNorm (`forward(x, residual)`), which returns both the normalised sum and the sum.
There is no batch dimension and no padding: tokens of all requests are rows of one matrix.

Tensor parallelism (`tp`, a `ParallelContext` of N ranks): the layers are built from `rank_spec`, the
model as one rank sees it (its heads, its share of the MLP: models/sharding.py), so qkv_proj and
gate_up_proj are column-parallel simply by being smaller; o_proj and down_proj are row-parallel (an
all-reduce), the embedding and the LM head vocab-parallel (layers/parallel_linear.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.activation import silu_and_mul
from minivllm.layers.custom_op import KernelSwitch
from minivllm.layers.linear import Linear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.parallel_linear import RowParallelLinear, VocabParallelEmbedding
from minivllm.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary, rotate
from minivllm.models.compiled_forward import Attend, CompiledForward
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.models.lm_head import LMHeadMixin
from minivllm.models.sharding import ShardLayout


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: ParallelContext) -> None:
        super().__init__()
        self.spec = spec  # this rank's view: its heads only
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size,
                               bias=spec.attention_bias)  # column-parallel: this rank's heads
        self.o_proj = RowParallelLinear(spec.q_size, spec.hidden_size, bias=spec.o_proj_bias, tp=tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def project(self, rope: RopeTables, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> q (T, Hq, D), k and v (T, Hkv, D), RoPE applied: everything before attention."""
        s = self.spec
        T, Hq = x.shape[0], s.num_attention_heads
        qk, v = self.qkv_proj(x).split([s.q_size + s.kv_size, s.kv_size], dim=-1)
        qk = qk.view(T, Hq + s.num_key_value_heads, s.head_dim)  # (T, Hq + Hkv, D): q's heads, then k's
        v = v.view(T, s.num_key_value_heads, s.head_dim)  # (T, Hkv, D)
        if s.qk_norm:  # Qwen3: q and k have their own norm weights
            return (*apply_rotary(self.q_norm(qk[:, :Hq]), self.k_norm(qk[:, Hq:]), rope), v)
        # Without qk-norm, q and k get the same rotation: rotate their heads in one call (half the ops).
        qk = rotate(qk, rope)
        return qk[:, :Hq], qk[:, Hq:], v

    def forward(self, rope: RopeTables, x: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x (T, hidden) -> o_proj(attention(q, k, v)) (T, hidden); `attend` returns (T, Hq*D)."""
        return self.o_proj(attend(*self.project(rope, x)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size  # this rank's share
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)  # column-parallel
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias, tp=tp)
        self.kernels: KernelSwitch | None = None  # silu·mul's C++ kernel, where set (layers/activation.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels))  # (T, 2I) -> (T, I) -> (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: ParallelContext) -> None:
        super().__init__()
        self.self_attn = Attention(spec, tp)
        self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    # Attention itself is the backend (eager) or an opaque op (compiled: models/compiled_forward.py), handed in
    # as `attend(q, k, v)`. The residual stream travels beside the hidden state, as in vLLM: each residual add
    # happens inside the next RMSNorm (`fused_add_rms_norm`, one pass), so a layer runs no add of its own (the
    # MLP's output is added by the next layer's input norm).
    def forward(self, rope: RopeTables, h: torch.Tensor, residual: torch.Tensor | None,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h (T, hidden), the last layer's MLP output (the embedding for layer 0, with residual None)
        -> (this layer's MLP output, the residual stream), each (T, hidden)."""
        if residual is None:
            normed, residual = self.input_layernorm(h), h
        else:
            normed, residual = self.input_layernorm(h, residual=residual)
        o = self.self_attn(rope, normed, attend)  # (T, hidden), after o_proj
        normed, residual = self.post_attention_layernorm(o, residual=residual)
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_size, spec.hidden_size, layout.vocab_start, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(LMHeadMixin, CausalLM):
    """Also serves Qwen2 and Qwen3 (their switches live in `spec`)."""

    supports_compile = True
    cpu_norm_rope_kernels = True

    def __init__(self, spec: ModelSpec, tp: ParallelContext | None = None) -> None:
        super().__init__(spec)
        self.tp = tp = tp if tp is not None else ParallelContext()
        self.shard_layout = layout = ShardLayout.of(spec, tp.rank, tp.world_size)
        self.model = DecoderModel(layout.rank_spec(spec), layout, tp)
        if not spec.tie_word_embeddings:  # vocab-parallel: this rank's rows
            self.lm_head = Linear(spec.hidden_size, layout.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # built on the right device by `init_rotary`

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.spec.head_dim, max_position, self.spec.rope, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer: (2, num_blocks, block_size, Hkv, D)
        backend: AttentionBackend,
        linear_attn: LinearAttnMetadata | None = None,  # no linear-attention layers here: always None
    ) -> torch.Tensor:  # (T, hidden)
        if self.compiled is not None and self.compiled.runs(input_ids.shape[0]):
            return self.compiled(self, input_ids, positions, meta, kv_caches, backend)
        return self.run_layers(input_ids, positions, lambda i, q, k, v: backend.forward(q, k, v, kv_caches[i], meta))

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The decoder, with attention as `attend(layer, q, k, v)`: the backend itself when eager, the
        opaque op that calls it when compiled (models/compiled_forward.py)."""
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        # once per step, shared by all layers (the C++ RoPE kernel reads the tables itself: no lookup)
        rope = self.rotary.lookup(positions, h.dtype, kernel=self.rotary.kernel_runs(h))
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(rope, h, residual, functools.partial(attend, i))
        return self.model.norm(h, residual=residual)[0]  # the last residual add, inside the final norm

    def compile_forward(self, sizes: tuple[int, ...]) -> None:
        """From now on, steps of exactly one of `sizes` tokens run one compiled graph (the model runner
        pads steps up to a size); each size is compiled the first time it runs."""
        self.compiled = CompiledForward(type(self).run_layers, sizes)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (S, hidden) -> (S, V)
        """The logits of the rows in `hidden`; under tensor parallelism on rank 0 only (None elsewhere):
        each rank computes its vocabulary slice (S, V/N), gathered on rank 0, which samples."""
        return self.tp.gather_last_dim(super().compute_logits(hidden))

