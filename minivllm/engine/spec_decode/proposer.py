"""The `Proposer` interface: whoever guesses the next tokens of the running sequences.

ONNX Runtime GenAI's engine lets the caller hand in drafts and verifies them in one step; minivllm's
two built-in proposers (n-gram lookup and a draft model) implement the same interface, so a caller's
own proposer plugs in the same way:

    class MyProposer(Proposer):
        def propose(self, requests: list[DraftRequest]) -> list[Draft]:
            return [Draft(my_guess(r.token_ids)[:r.max_tokens]) for r in requests]

    LLM(model, speculative_config={"proposer": MyProposer(), "num_speculative_tokens": 3})

A proposer only guesses: the target model decides. Wrong guesses cost a little compute, never
correctness. `Draft.probs` is the proposer's distribution over each drafted token (a draft model's
softmax); leave it None for a deterministic guess (n-gram, a caller's): it then counts as one-hot,
which is exactly right for rejection sampling of a deterministic proposal.
"""

from __future__ import annotations

import abc
from array import array
from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """What a proposer may read about one sequence (never write: its tokens are committed)."""

    request_id: str
    token_ids: array  # prompt + output so far (array("i"))
    max_tokens: int  # at most this many drafts: num_speculative_tokens, max_tokens and max_model_len allow
    # Its blocks so far: they cover its tokens, not yet the drafts (the next schedule() reserves those
    # slots, as many as its budget and the pool allow: fewer drafts may be verified than proposed).
    block_table: tuple[int, ...]
    num_computed_tokens: int  # the target's K/V cover positions [0, num_computed_tokens)
    sampling_params: SamplingParams  # the request's (a proposer may sample like the target)
    seed: int  # the sequence's sampling seed


@dataclass
class Draft:
    token_ids: list[int]  # may be shorter than max_tokens, or empty (nothing to propose)
    probs: torch.Tensor | None = None  # (len(token_ids), V): the proposal distribution; None = one-hot


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order."""

    def on_commit(self, seq_ids: list[str], num_computed: list[int]) -> None:
        """The target verified up to `num_computed` tokens (a proposer with a cache rolls back)."""

    def on_free(self, request_id: str) -> None:
        """The sequence finished or was preempted: forget what is kept for it."""
