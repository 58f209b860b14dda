"""Runs min-p before top-p: top-p then measures the mass of what min-p kept, renormalised.

A wrong solution from a student walkthrough (tests/test_hands_on_mistakes.py: WRONG)."""
from __future__ import annotations
import torch
from minivllm.layers.sampler import SamplingFilter, SamplingTensors


class MyFilter(SamplingFilter):
    name = "my-filter"

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        out = logits.clone()
        R, V = out.shape
        for r in range(R):
            row = out[r]
            k = int(sampling.top_ks[r])
            p = float(sampling.top_ps[r])
            m = float(sampling.min_ps[r])
            if k < V:
                kth = torch.topk(row, k).values[-1]
                row[row < kth] = float("-inf")
            if m > 0.0:
                probs = row.softmax(-1)
                row[probs < m * probs.max()] = float("-inf")
            if p < 1.0:
                probs = row.softmax(-1)
                sp, idx = probs.sort(descending=True)
                before = sp.cumsum(0) - sp
                drop = idx[before >= p]
                row[drop] = float("-inf")
        return out
