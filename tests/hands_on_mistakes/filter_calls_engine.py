"""Cheat (filter): calls the engine's own filter function, imported under another name."""

from __future__ import annotations

from minivllm.layers.sampler import SamplingFilter
from minivllm.layers.sampler import apply_top_k_top_p_min_p as mine


class Calls(SamplingFilter):
    name = "cheat"

    def __call__(self, logits, sampling):
        return mine(logits, sampling)
