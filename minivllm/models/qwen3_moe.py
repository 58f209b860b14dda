"""Qwen3-MoE and Qwen2-MoE: the Llama decoder (models/llama.py) with a mixture of experts in place of the MLP.

    input_ids (T,) -> embed -> [ RMSNorm -> attention -> +residual -> RMSNorm -> MoE block -> +residual ] x L
                   -> RMSNorm -> hidden (T, H)

    MoE block (HF's Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock), x (T, H):
        router_logits = gate(x)                          (T, E)   a plain Linear(H, E, bias=False)
        out = experts(x, router_logits)                  (T, H)   top-k routing + the active experts only
                                                                  (layers/fused_moe.py, layers/moe_router.py)
        Qwen2-MoE: out += sigmoid(shared_expert_gate(x)) * shared_expert(x)   an always-on gated MLP

Only the MLP differs from the dense decoder: the attention, the norms, RoPE, the residual stream and the
LM head are Llama's, and so are the dense layers that `mlp_only_layers` / `decoder_sparse_step` keep
(`MoeSpec.is_sparse`). The two families differ in switches of `ModelSpec`, as Qwen2 and Qwen3 do:
  * Qwen3-MoE: per-head q/k RMSNorm (`qk_norm`), no shared expert;
  * Qwen2-MoE: q/k/v bias (`attention_bias`), a shared expert of `shared_expert_intermediate_size`.
So one class serves both names (models/__init__.py), as `LlamaForCausalLM` serves Qwen2 and Qwen3.

Tensor parallelism (models/sharding.py): attention as in the dense decoder; each rank holds a slice of
EVERY expert's width (and of the shared expert's), so its experts' output is a partial sum, as a
row-parallel down_proj's is; the shared expert's partial sum is added to it and ONE all-reduce ends the
block. The router and the shared expert's gate are replicated: every rank routes every token the same way.

No real MoE checkpoint is reachable offline: the tests run tiny random configs against HF transformers.
Eager only (`supports_compile` False): the engine does not compile or graph-capture MoE models yet, and on
CPU the methods loop over the active experts the routing chose. The attention, norms, RoPE and dense MLPs
take minivllm's C++ kernels on the CPU as Llama's do.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.fused_moe import FusedMoE, fused_moe_layers
from minivllm.layers.linear import Linear
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, tp: ParallelContext) -> None:
        super().__init__()
        moe = spec.moe  # this rank's view: its share of every expert's width
        self.tp = tp
        self.gate = Linear(spec.hidden_size, moe.num_experts, bias=False)  # the router, replicated
        self.experts = FusedMoE(moe.num_experts, moe.num_experts_per_tok, spec.hidden_size,
                                moe.moe_intermediate_size, renormalize=moe.norm_topk_prob)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:  # Qwen2-MoE; its down_proj does not all-reduce (the block does)
            shared = replace(spec, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert = MLP(shared, ParallelContext())
            self.shared_expert_gate = Linear(spec.hidden_size, 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        out = self.experts(x, self.gate(x))  # (T, H); router_logits (T, E)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # gate (T, 1)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out  # one all-reduce per block


class MoeDecoderLayer(DecoderLayer):
    """Llama's layer (attention, norms, forward) with the MoE block as its `mlp` on a sparse layer."""

    def __init__(self, spec: ModelSpec, tp: ParallelContext, layer_idx: int) -> None:
        super().__init__(spec, tp)
        if spec.moe.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(spec, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Also serves Qwen2MoeForCausalLM (its switches live in `spec`)."""

    supports_compile = False
    eager_reason = ("the engine does not compile or graph-capture MoE models yet; the CPU methods loop over the "
                    "experts the routing chose (a data-dependent loop)")
    compile_forward = CausalLM.compile_forward  # refuses: Llama's would compile a graph broken at every layer

    def __init__(self, spec: ModelSpec, tp: ParallelContext | None = None) -> None:
        if spec.moe is None:
            raise ValueError(f"{spec.architecture} has no mixture-of-experts numbers (ModelSpec.moe is None)")
        super().__init__(spec, tp)
        # The model is built on the meta device (engine/worker/loading.py): the dense layers Llama's constructor
        # made are replaced before any memory is given to them.
        rank_spec = self.shard_layout.rank_spec(spec)
        self.model.layers = nn.ModuleList(MoeDecoderLayer(rank_spec, self.tp, i)
                                          for i in range(spec.num_hidden_layers))

    def expert_layers(self) -> list[FusedMoE]:
        """Every sparse layer's experts, in layer order (their `last_load` is the step's expert load)."""
        return fused_moe_layers(self)
