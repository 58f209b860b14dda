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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


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


class RequestMetrics(NamedTuple):
    """When a request arrived, was first scheduled, got its first token and finished (vLLM's `RequestMetrics`
    names; `time.perf_counter()` seconds, so only differences mean anything). An n > 1 request: the first of its
    sequences scheduled / to produce a token, the last to finish. None: not yet (or never: a request refused or
    aborted while waiting is never scheduled). vLLM's last_token_time and per-step model times are not kept.
    A NamedTuple, not a dataclass: one is built for every output of every step (a tuple costs a tenth)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first scheduled: what vllm:request_queue_time_seconds observes."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @classmethod
    def of(cls, seqs: Sequence[Any]) -> RequestMetrics:
        """A request's times from its sequences (the engine's: one, or n): the first scheduled, the first token,
        the last finish."""
        if len(seqs) == 1:  # (every output of every step: the common case, without lists)
            s = seqs[0]
            return cls(s.arrival_time or 0.0, s.first_scheduled_time, s.first_token_time, s.finished_time)
        finished = [s.finished_time for s in seqs]
        return cls(seqs[0].arrival_time or 0.0, _first(s.first_scheduled_time for s in seqs),
                   _first(s.first_token_time for s in seqs), None if None in finished else max(finished))


def _first(times: Iterable[float | None]) -> float | None:
    return min((t for t in times if t is not None), default=None)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None  # its times (filled by the engine's output processor)
    prompt_logprobs: PromptLogprobs | None = None
