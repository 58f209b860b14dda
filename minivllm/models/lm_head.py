"""The LM head, the same in every decoder family (Llama, Gemma 3, Qwen3.5).

A family that keeps `self.model.embed_tokens`, and an `self.lm_head` Linear when the checkpoint does not
tie it to the embedding, gets two of `CausalLM`'s members by listing `LMHeadMixin` before `CausalLM`:

    lm_head_layer   the layer whose weight (V, hidden) multiplies: `lm_head`, or the embedding when tied
                    (vLLM: `self.lm_head = self.model.embed_tokens`)
    compute_logits  hidden (S, hidden) -> logits (S, V), through that layer's `quant_method`, as every
                    `Linear` computes (layers/linear.py); the embedding has one for this use

Llama overrides `compute_logits` to gather each tensor-parallel rank's vocabulary slice on rank 0.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.linear import Linear
from minivllm.models.hf_config import ModelSpec


class LMHeadMixin:
    spec: ModelSpec
    model: nn.Module  # with .embed_tokens (a VocabParallelEmbedding)
    lm_head: Linear  # only where the checkpoint does not tie it to the embedding

    @property
    def lm_head_layer(self) -> nn.Module:
        return self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head

    @property
    def lm_head_weight(self) -> torch.Tensor:  # (V, hidden); under tensor parallelism this rank's V / N rows
        return self.lm_head_layer.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (S, hidden) -> (S, V)
        head = self.lm_head_layer
        return head.quant_method.apply(head, hidden)
