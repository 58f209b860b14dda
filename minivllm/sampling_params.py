"""Per-request sampling options, with vLLM's field names.

`SamplingParams` is validated when it is built: a bad value raises `ValueError` naming the field and
what to change, before the request ever reaches the engine. Everything the sampler and the stop
checker need about one request lives here; nothing about batching does.

Order of the logit transforms (the same as HF transformers' `generate`):
temperature -> top-k -> top-p -> min-p -> draw. `temperature == 0` means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Normalised copies (frozen dataclass: set through object.__setattr__ in __post_init__).
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _stop_token_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {why}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "use 0 for greedy or a positive number")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "use -1 or 0 to disable, or a positive integer")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]; 1 disables it")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]; 0 disables it")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1, or None to run until max_model_len")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        object.__setattr__(self, "_stop", stop)
        object.__setattr__(self, "_stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_token_ids
