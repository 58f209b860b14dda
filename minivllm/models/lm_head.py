"""The LM head and the CPU matmul plan, the same in every decoder family (Llama, Gemma 3, Qwen3.5).

A family that keeps `self.model.embed_tokens`, `self.model.layers`, an `self.lm_head` Linear when the
checkpoint does not tie it to the embedding, and one `self.matmul_plan` shared by all its Linears, gets
three of `CausalLM`'s methods by listing `LMHeadMixin` before `CausalLM`:

    lm_head_weight      (V, hidden): the embedding's rows when tied, else lm_head's
    compute_logits      hidden (S, hidden) -> logits (S, V), through the same plan as every Linear
    plan_matmuls        time the CPU matmul forms over the Linears in forward order, then the LM head
                        (decode rows only: prefill computes logits for its last row alone), once

Llama overrides `compute_logits` to gather each tensor-parallel rank's vocabulary slice on rank 0.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.linear import Linear, LinearPlan, linear
from minivllm.cpu.matmul_plan import MatmulPlan
from minivllm.cpu.tuner import Tuning
from minivllm.models.hf_config import ModelSpec


class LMHeadMixin:
    spec: ModelSpec
    model: nn.Module  # with .embed_tokens and .layers
    lm_head: Linear  # only where the checkpoint does not tie it to the embedding
    matmul_plan: LinearPlan

    @property
    def lm_head_weight(self) -> torch.Tensor:  # (V, hidden); under tensor parallelism this rank's V / N rows
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (S, hidden) -> (S, V)
        return linear(hidden, self.lm_head_weight, plan=self.matmul_plan)

    def plan_matmuls(self, tuning: Tuning = "cached") -> LinearPlan:
        """Time the CPU matmul forms over this model's weights, in forward order, and keep the fastest
        per shape and row bucket (once; a GPU model keeps F.linear; batch-invariant: its fixed tiles are
        never timed). Called at warm-up."""
        if isinstance(self.matmul_plan, MatmulPlan) and self.matmul_plan.measured_with_threads is None:
            # an int8 layer (layers/quantization.py) is no `Linear`: nothing to time
            weights = [m.weight for m in self.model.layers.modules() if isinstance(m, Linear)]
            self.matmul_plan.measure(weights + [self.lm_head_weight], decode_only=(self.lm_head_weight,),
                                     tuning=tuning)
        return self.matmul_plan
