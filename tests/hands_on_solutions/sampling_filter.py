"""Reference solution, hands-on 3: top-k, then top-p, then min-p as the sampler's filter (graded by
`python -m minivllm.teaching.grade_hands_on filter tests/hands_on_solutions/sampling_filter.py`).

Kept out of the student's way; tests/test_hands_on.py grades it and plants mistakes in copies of it."""

from __future__ import annotations

import torch

from minivllm.layers.sampler import SamplingFilter, SamplingTensors

NEG_INF = float("-inf")


class TopKTopPMinPFilter(SamplingFilter):
    """Row by row: each step removes tokens (-inf) from what the step before kept."""

    name = "hands-on-reference"

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        out = logits.clone()  # (R, V)
        for r, row in enumerate(out):  # `row` is a view: editing it edits `out`
            k, p, m = int(sampling.top_ks[r]), float(sampling.top_ps[r]), float(sampling.min_ps[r])
            if 0 < k < row.numel():
                kth = row.topk(k).values[-1]
                row[row < kth] = NEG_INF  # ties with the k-th stay
            if p < 1.0:
                ranked, order = row.sort(descending=True)
                probs = ranked.softmax(-1)  # renormalised over what top-k kept
                mass_above = probs.cumsum(-1) - probs
                row[order[mass_above >= p]] = NEG_INF  # the token that crosses p is kept
            if m > 0.0:
                probs = row.softmax(-1)
                row[probs < m * probs.max()] = NEG_INF
        return out
