"""Per-request sampling options, with vLLM's field names.

`SamplingParams` is validated when it is built: a bad value raises `ValueError` naming the field and
what to change, before the request ever reaches the engine. Everything the sampler and the stop
checker need about one request lives here; nothing about batching does.

Order of the logit transforms (vLLM's; see layers/logits_processors.py and layers/sampler.py):

    raw logits ──> logprobs (if asked: the model's own distribution)
               ──> allowed_token_ids ─> bad_words ─> min_tokens ─> logit_bias      (masks and biases)
               ──> repetition_penalty (prompt + output) ─> frequency / presence (output)
               ──> structured_outputs: the grammar's token bitmask, last (engine/structured_output/grammar.py)
               ──> temperature ─> top-k ─> top-p ─> min-p ─> draw (argmax when greedy)

`n > 1` makes the request n sequences when it arrives (engine/processing/parallel_sampling.py): they share the
prompt's KV blocks through the prefix cache, and child i draws with `seed + i` when a seed is given
(vLLM's rule).

Numbers are checked strictly at this boundary: NaN, infinities and booleans are refused (a NaN
temperature would poison a whole batch's sampling), numpy integers are accepted and stored as Python
ints. Token ids are checked against the model's vocabulary when the request reaches the engine. Lists
whose cost grows each step are bounded (MAX_STOP_STRINGS, MAX_BAD_WORDS), with an error naming the limit.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.structured_outputs import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# What one request may ask, bounded: the stop strings are searched after every token (the cost grows with
# their number), and a bad word costs a tokenization at admission. OpenAI allows 4 stop sequences.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1000
MAX_BAD_WORDS = 4096
SEED_RANGE = (-(2**63), 2**63)  # int64, as the server takes: the sampler's noise key is 64 bits (seed mod 2**64)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request while it runs (vLLM's names)."""

    CUMULATIVE = 0  # every step that changed it: the whole output so far
    DELTA = 1  # every step that changed it: only what is new since its previous output
    FINAL_ONLY = 2  # nothing until it finishes, then the whole output (what `LLM.generate` asks)


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
    detokenize: bool = True  # False: token ids only, `text` stays "" (no stop strings then)
    n: int = 1  # completions per prompt (n sequences sharing the prompt's KV blocks: prefix cache)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF's: divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    bad_words: list[str] | None = None  # never generate these words (token sequences)
    logprobs: int | None = None  # return the N most likely tokens (+ the sampled one) per output token
    prompt_logprobs: int | None = None  # the same for each prompt token (bypasses the prefix cache)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # see RequestOutputKind
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a schema/regex/grammar
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
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise bad("seed", "must be a 64-bit integer (from -2**63 to 2**63 - 1): seeds further apart "
                                  "than 2**64 would share their random draws")
        if self.max_tokens is not None:
            setfield("max_tokens", as_int("max_tokens", "must be an integer >= 1, or None to run until "
                                                        "max_model_len", lo=1))
        setfield("min_tokens", as_int("min_tokens", "must be an integer >= 0", lo=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"SamplingParams.stop=<{len(stop)} strings, the longest {max(map(len, stop))} "
                             f"characters> is invalid: give at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters each (each is searched for after every token)")
        if stop and not self.detokenize:
            raise bad("stop", "stop strings are found in the output text, which detokenize=False does not make: "
                              "use stop_token_ids, or detokenize=True")
        ids = self.stop_token_ids
        if ids is not None and (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")):
            raise bad("stop_token_ids", "must be a list of token ids")
        setfield("n", as_int("n", "must be an integer >= 1", lo=1))
        setfield("presence_penalty", as_float("presence_penalty", "must be in [-2, 2]", lambda v: -2 <= v <= 2))
        setfield("frequency_penalty", as_float("frequency_penalty", "must be in [-2, 2]", lambda v: -2 <= v <= 2))
        setfield("repetition_penalty", as_float("repetition_penalty", "must be > 0 (1 disables it)",
                                                lambda v: v > 0))
        for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                lo = 1 if name == "truncate_prompt_tokens" else 0
                setfield(name, as_int(name, f"must be an integer >= {lo}, or None", lo=lo))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            bias = {}
            for k, v in self.logit_bias.items():
                key = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k  # JSON keys are strings
                if isinstance(key, bool) or not hasattr(key, "__index__") or isinstance(v, bool) \
                        or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise bad("logit_bias", "must map token ids to finite numbers")
                bias[operator.index(key)] = min(100.0, max(-100.0, float(v)))  # OpenAI's range
            setfield("logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if isinstance(allowed, (str, bytes)) or not hasattr(allowed, "__iter__"):
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            allowed = [as_int("allowed_token_ids", "must be a non-empty list of token ids", t, lo=0) for t in allowed]
            if not allowed:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            setfield("allowed_token_ids", allowed)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in words):
                raise bad("bad_words", "must be a list of non-empty strings")
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"SamplingParams.bad_words=<{len(words)} words> is invalid: give at most "
                                 f"{MAX_BAD_WORDS} (each is tokenized when the request arrives)")
            setfield("bad_words", list(words))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind: CUMULATIVE, DELTA or FINAL_ONLY")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (from minivllm import "
                                            "StructuredOutputsParams)")
        why = "must be a list of non-negative token ids"
        object.__setattr__(self, "_stop", stop)
        object.__setattr__(self, "_stop_token_ids", tuple(as_int("stop_token_ids", why, t, lo=0)
                                                          for t in (ids or ())))

    @functools.cached_property  # read for every row of every step; the fields never change
    def greedy(self) -> bool:
        """Temperatures this small are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < _SAMPLING_EPS

    @functools.cached_property  # read for every row of every step; the fields never change
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @functools.cached_property  # read for every row of every step; the fields never change
    def needs_logits_processing(self) -> bool:
        """Does anything change this request's logits before temperature (besides min_tokens)?"""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None \
            or bool(self.bad_words) or self.structured_outputs is not None

    @functools.cached_property  # read for every output of a running request with stop strings
    def longest_stop(self) -> int:
        return max(map(len, self._stop), default=0)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_token_ids
