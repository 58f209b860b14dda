"""What the engine hands back: vLLM's `RequestOutput`, `CompletionOutput` and `Logprob`.

`text` and `token_ids` are cumulative (everything generated so far), as in vLLM's default output
kind; `LLMEngine.step()` returns one `RequestOutput` for each request that changed in that step. A
request with `SamplingParams(n=...)` has n `CompletionOutput`s, one per sequence of the request (`index`).

finish_reason is one of
  "stop"    EOS, a stop token id or a stop string (`stop_reason` says which, None for EOS)
  "length"  max_tokens or max_model_len reached
  "abort"   `abort_request` was called
  "error"   the request can never run, or failed on its own; `RequestOutput.error` says why

Logprobs are those of the model's own distribution — log_softmax of the raw logits, before
penalties, biases, temperature or top-k/top-p (vLLM's default "raw" mode) — so they say what the
model thought, not what the sampler was allowed to pick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """One candidate token at one position (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the model's most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob, holding the top-N candidates plus the actual token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has nothing before it: None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # a FinishReason's value (engine/request/sequence.py): vLLM's plain strings
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs (if logprobs asked)
    logprobs: SampleLogprobs | None = None  # one entry per generated token (if logprobs asked)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
