"""Why a request's numbers depend on its neighbours, measured live (notebook 15; docs/concepts/batch-invariance.md).

    row_drift(weight, sizes)                    one row multiplied among m rows vs among 16: how many of its
                                                outputs come out with other bits, for each m
    alone_vs_crowd(llm, prompt, others, params) one greedy request run alone, then beside `others`:
                                                its tokens and logprobs compared, the crowd's tokens/s

Nothing here changes the engine: the first asks `torch.nn.functional.linear` what every matmul of a
batched step asks it, the second sends requests through `LLM.generate` as a user would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams


def row_drift(weight: torch.Tensor, sizes: Sequence[int] = (1, 2, 3, 5, 8, 16), reference_rows: int = 16,
              seed: int = 0) -> dict[int, int]:
    """For each m in `sizes`: how many of row 0's outputs differ (in any bit) when x W^T is computed for m
    rows rather than `reference_rows`. The rows are the same numbers each time; only their count changes,
    and with it the blocking the matmul library picks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(max(sizes), reference_rows), weight.shape[1], generator=g).to(weight.dtype)  # (M, in)
    reference = F.linear(x[:reference_rows], weight)[0]  # (out,)
    return {m: int((F.linear(x[:m], weight)[0] != reference).sum()) for m in sizes}


class AloneVsCrowd(NamedTuple):
    same_tokens: int  # how many leading tokens the two runs share
    tokens: int  # tokens generated alone
    logprob_bits_differ: int  # of the shared tokens, how many got a logprob with other bits
    max_logprob_gap: float  # the largest |alone - crowd| over the shared tokens
    crowd_tok_s: float  # the crowd's generated tokens per second, all requests together


def alone_vs_crowd(llm: LLM, prompt: str, others: Sequence[str], params: SamplingParams) -> AloneVsCrowd:
    """`prompt` alone, then first among `others` in one `generate` call (so they share steps and the step's
    token budget). `params` should be greedy and ask for logprobs (logprobs=0: the chosen token's)."""
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    start = time.perf_counter()
    crowd = llm.generate([prompt, *others], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    first = crowd[0].outputs[0]
    same = next((i for i, (a, b) in enumerate(zip(alone.token_ids, first.token_ids)) if a != b),
                min(len(alone.token_ids), len(first.token_ids)))
    gaps = [abs(a[t].logprob - b[t].logprob)
            for t, a, b in zip(alone.token_ids[:same], alone.logprobs or [], first.logprobs or [])]
    generated = sum(len(out.outputs[0].token_ids) for out in crowd)
    return AloneVsCrowd(same, len(alone.token_ids), sum(gap != 0 for gap in gaps), max(gaps, default=0.0),
                        generated / seconds)
