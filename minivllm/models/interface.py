"""`CausalLM`: what the engine needs of a model, whatever its family.

Every family (Llama/Qwen2/Qwen3 in llama.py, Gemma 3 in gemma3.py, the Qwen3.5 hybrid in qwen3_5.py)
subclasses it, so the model runner calls one forward with one return type and never asks `hasattr`:

    forward(input_ids (T,), positions (T,), attn_metadata, kv_caches, backend, linear_attn=None)
        -> hidden (T, hidden_size)
    compute_logits(hidden (S, hidden_size)) -> logits (S, V)   (None on a tensor-parallel worker:
                                                                the logits are gathered on rank 0)
    init_rotary(max_position, device)      the RoPE tables, built once the weights are on the device
    lm_head_layer                          the layer whose weight computes the logits (the embedding when tied)
    compile_forward(sizes)                 only where `supports_compile` (models/compiled_forward.py);
                                           elsewhere `eager_reason` says why not
    expert_layers()                        a mixture of experts' `FusedMoE` layers, in order ([] for a dense model)

A model is built from plain layers and knows nothing of how its products run on this machine: the
engine attaches that from outside at warm-up (minivllm/cpu/attach.py). `cpu_norm_rope_kernels` says
whether its RMSNorms, RoPE and MLP activation are the ones minivllm's C++ kernels compute (the Llama family).

`linear_attn` is for hybrid models: where each row group's recurrent state lives (the pools and the
slots; layers/linear_attn_metadata.py). A model whose layers keep such a state says so with
`needs_state_pool` and then requires it; the others never receive it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from minivllm.layers.attention import AttentionBackend, AttentionMetadata
from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata
from minivllm.models.compiled_forward import CompiledForward
from minivllm.models.hf_config import ModelSpec


class CausalLM(nn.Module):
    supports_compile: ClassVar[bool] = False  # can `compile_forward` make graphs of its forward?
    # Why not, in words the engine logs and `minivllm bench` prints (engine/worker/loading.py): each family its own.
    eager_reason: ClassVar[str] = "its forward is not written for torch.compile"
    needs_state_pool: ClassVar[bool] = False  # hybrid: linear-attention layers with a recurrent state
    cpu_norm_rope_kernels: ClassVar[bool] = False  # Llama's RMSNorm, rotate-half RoPE and silu·mul MLP

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.compiled: CompiledForward | None = None  # set by `compile_forward`; None: every step eager

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per attention layer: (2, num_blocks, block_size, Hkv, D)
        backend: AttentionBackend,
        linear_attn: LinearAttnMetadata | None = None,
    ) -> torch.Tensor:  # (T, hidden)
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (S, hidden) -> (S, V)
        raise NotImplementedError

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        raise NotImplementedError

    @property
    def lm_head_layer(self) -> nn.Module:  # its `weight` (V, hidden) and `quant_method` compute the logits
        raise NotImplementedError

    def expert_layers(self) -> list[FusedMoE]:  # their `last_load`: a step's expert load (engine/worker/expert_load.py)
        return []

    def compile_forward(self, sizes: tuple[int, ...]) -> None:
        raise ValueError(f"{type(self).__name__} cannot be compiled (supports_compile is False)")
