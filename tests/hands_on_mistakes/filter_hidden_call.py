"""Cheat (filter): the engine's filter reached by a name built at run time: the grader's watch names it."""

from __future__ import annotations

import minivllm.layers.sampler as sampler_module
from minivllm.layers.sampler import SamplingFilter


class Hidden(SamplingFilter):
    name = "cheat"

    def __call__(self, logits, sampling):
        return getattr(sampler_module, "apply_" + "top_k_top_p_min_p")(logits, sampling)
