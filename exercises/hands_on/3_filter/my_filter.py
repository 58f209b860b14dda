"""Hands-on 3: top-k, top-p and min-p, as the filter the engine's sampler draws through.

The sampler divides each row's logits by its temperature (so you must not), calls your filter, and draws from
softmax(what you return): a removed token is one you set to -inf. Per row r, with
k = sampling.top_ks[r] (the vocabulary size means off), p = sampling.top_ps[r] (1 = off) and
m = sampling.min_ps[r] (0 = off), in this order, each on what the step before kept:

  * top-k: keep the k most likely tokens (and any tied with the k-th: a tie AT rank k keeps more than k);
  * top-p: keep the most likely tokens until their probability mass reaches p, the token that crosses
    it included. The probabilities are those of what top-k kept (renormalised);
  * min-p: keep the tokens whose probability is at least m times the most likely one's.

Return logits (or log-probabilities) with the removed tokens at -inf: the sampler renormalises by
itself, so a kept token must keep its probability relative to the other kept ones. Every row the
sampler draws from must keep at least one token. Read `SamplingFilter` and `SamplingTensors` in
minivllm/layers/sampler.py (the seam) first. A loop over the rows is fine.

Grade:  python -m minivllm.teaching.grade_hands_on filter exercises/hands_on/3_filter/my_filter.py
        (1: probes, one parameter at a time, then random mixes, against the engine's own TopKTopPMinP:
        the tokens kept and their probabilities; 2: the engine samples through it, seeded: the same
        tokens as with its own filter. --no-engine: 1 only)
Use:    LLM(model, sampling_filter=MyFilter())
"""

from __future__ import annotations

import torch

from minivllm.layers.sampler import SamplingFilter, SamplingTensors


class MyFilter(SamplingFilter):
    name = "my-filter"

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:  # (R, V) -> (R, V)
        """The temperature-scaled logits with every token that top-k, top-p or min-p removes set to -inf."""
        raise NotImplementedError
