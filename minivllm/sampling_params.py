"""Per-request sampling options, with vLLM's field names.

`SamplingParams` is validated when it is built: a bad value raises `ValueError` naming the field and
what to change, before the request ever reaches the engine. Everything the sampler and the stop
checker need about one request lives here; nothing about batching does.

Order of the logit transforms (the same as HF transformers' `generate`):
temperature -> top-k -> top-p -> min-p -> draw. `temperature == 0` means greedy (argmax).

Numbers are checked strictly at this boundary: NaN, infinities and booleans are refused (a NaN
temperature would poison a whole batch's sampling), numpy integers are accepted and stored as Python
ints. Token ids are checked against the model's vocabulary when the request reaches the engine.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


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

        def setfield(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # frozen: normalise in place, once

        def as_int(name: str, why: str, value: object = None, *, lo: int | None = None) -> int:
            """An integer (numpy integers too, never a bool) >= lo, as a Python int."""
            value = getattr(self, name) if value is None else value
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise bad(name, why)
            value = operator.index(value)
            if lo is not None and value < lo:
                raise bad(name, why)
            return value

        def as_float(name: str, why: str, ok: Callable[[float], bool]) -> float:
            """A finite real number (never a bool, NaN or infinity) accepted by `ok`, as a float."""
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise bad(name, why)
            value = float(value)
            if not math.isfinite(value) or not ok(value):
                raise bad(name, why)
            return value

        setfield("temperature", as_float("temperature", "use 0 for greedy or a positive number",
                                         lambda v: v >= 0))
        setfield("top_k", as_int("top_k", "use -1 or 0 to disable, or a positive integer", lo=-1))
        setfield("top_p", as_float("top_p", "must be in (0, 1]; 1 disables it", lambda v: 0 < v <= 1))
        setfield("min_p", as_float("min_p", "must be in [0, 1]; 0 disables it", lambda v: 0 <= v <= 1))
        if self.seed is not None:
            setfield("seed", as_int("seed", "must be an integer or None"))
        if self.max_tokens is not None:
            setfield("max_tokens", as_int("max_tokens", "must be an integer >= 1, or None to run until "
                                                        "max_model_len", lo=1))
        setfield("min_tokens", as_int("min_tokens", "must be an integer >= 0", lo=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        ids = self.stop_token_ids
        if ids is not None and (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")):
            raise bad("stop_token_ids", "must be a list of token ids")
        why = "must be a list of non-negative token ids"
        object.__setattr__(self, "_stop", stop)
        object.__setattr__(self, "_stop_token_ids", tuple(as_int("stop_token_ids", why, t, lo=0)
                                                          for t in (ids or ())))

    @property
    def greedy(self) -> bool:
        """Temperatures this small are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < _SAMPLING_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_token_ids
