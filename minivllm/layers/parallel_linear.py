"""The layers that communicate under tensor parallelism (Megatron-LM's split, as vLLM names it).

    column-parallel   y_r = x W_r^T           W_r: rank r's ROWS of W (its heads, its MLP slice).
                      A plain `Linear` of the smaller size: each rank keeps its slice of y, and the
                      next layer wants exactly that slice, so nothing is sent.
    row-parallel      y = sum_r x_r W_r^T + b  W_r: rank r's COLUMNS of W, x_r: its slice of x (what
                      the column-parallel layer before produced). Each rank has a partial sum of
                      the whole output; one all-reduce adds them up (`RowParallelLinear`).
    vocab-parallel    rank r holds embedding rows [r V/N, (r+1) V/N): it looks up the tokens that fall
                      in its range, writes zeros for the others, and an all-reduce assembles the rows
                      (`VocabParallelEmbedding`). The LM head reuses the same split: each rank computes
                      its slice of the logits, gathered on rank 0 (`ParallelContext.gather_last_dim`).

So a decoder layer communicates twice: one all-reduce after o_proj, one after down_proj. With
one rank (`ParallelContext()`) both classes compute exactly what `Linear` / `nn.Embedding` did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.linear import Linear, LinearMethodBase, UnquantizedLinearMethod


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b. `in_features` is this rank's share; the bias is whole and
    added once, after the sum (adding it on every rank would count it N times)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        if self.tp.world_size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.quant_method.apply(self, x, None))  # (T, out), summed over ranks
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` whose rows are split over the ranks; the parameter is still called `weight`. Where the
    checkpoint ties the LM head to it, the logits are `quant_method.apply(self, hidden)` (models/lm_head.py),
    as vLLM's `ParallelLMHead` computes them, so the head's product is attached like a `Linear`'s."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, tp: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # (V / N, H): this rank's rows
        self.vocab_start, self.tp = vocab_start, tp
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()  # used only as the tied LM head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # (T,) tokens another rank holds
        h = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # (T, H)
        h.masked_fill_(elsewhere[:, None], 0.0)
        return self.tp.all_reduce(h)  # exactly one rank contributes each row: the sum is exact
