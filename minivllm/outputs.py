"""What the engine hands back: vLLM's `RequestOutput` and `CompletionOutput`.

`text` and `token_ids` are cumulative (everything generated so far), as in vLLM's default output
kind; `LLMEngine.step()` returns one `RequestOutput` for each request that changed in that step.

finish_reason is one of
  "stop"    EOS, a stop token id or a stop string (`stop_reason` says which, None for EOS)
  "length"  max_tokens or max_model_len reached
  "abort"   `abort_request` was called
  "error"   the request can never run; `RequestOutput.error` says which limit and what to change
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

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
