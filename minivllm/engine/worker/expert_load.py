"""The step's expert load: how many routes each expert of a mixture-of-experts model served.

Every `FusedMoE` (layers/fused_moe.py) keeps `last_load`, the routes its last forward sent to each expert:
T tokens, k experts each, T*k routes in all. After the forward the model runner reads them here, once per
step, and hands their sum over the sparse layers to the scheduler side as plain ints
(`ModelRunnerOutput.expert_load`); `EngineStats` keeps the step's and a running total, and `/metrics` exports
the total as `minivllm:moe_expert_routes_total{expert}`.

    3 tokens, k = 2, two sparse layers of 4 experts (12 routes):
        layer 0 last_load   [3, 0, 1, 2]
        layer 1 last_load   [2, 1, 3, 0]
        expert_load         (5, 1, 4, 2)      what the step reports

What it promises, and why:
  * The sparse layers are found once, when the runner is built (`ExpertLoad(model)`): a walk of the model's
    modules costs ~16 us a layer, 0.76 ms a step on a 48-layer MoE, more than the rest of this together.
  * One host sync per step for an MoE model (the layers' counts stacked on the device, summed, one
    `.tolist()`), none for a dense model: its `expert_layers()` is empty, the answer is () without a tensor.
  * Expert e of one layer and expert e of the next are different weights: the sum is per expert INDEX, the
    load-balance view of a step (does the router spread tokens, or crowd a few experts?), not a map per layer
    (that would be E x layers series on /metrics).
  * Every row the forward computed counts, rows of drafts later rejected and recomputed tokens included:
    it is the experts' work, not the tokens committed.
  * Under tensor parallelism every rank routes every token the same way (the router is replicated:
    models/qwen3_moe.py), so rank 0's counts, the only ones the engine reads, are the model's.
"""

from __future__ import annotations

import torch

from minivllm.layers.fused_moe import FusedMoE
from minivllm.models.interface import CausalLM


class ExpertLoad:
    """A model's sparse layers, found once; `read()` after each forward gives the step's routes per expert."""

    def __init__(self, model: CausalLM) -> None:
        self.layers: list[FusedMoE] = model.expert_layers()  # [] for a dense model

    def read(self) -> tuple[int, ...]:
        """Routes per expert index of the last forward, summed over the sparse layers; () for a dense model."""
        loads = [layer.last_load for layer in self.layers if layer.last_load is not None]  # (E,) each
        if not loads:
            return ()
        return tuple(torch.stack(loads).sum(dim=0).tolist())  # (num_layers, E) -> (E,): the step's one host sync
