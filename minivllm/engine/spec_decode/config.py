"""`SpeculativeConfig`: vLLM's `speculative_config` dict, parsed and validated once.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "path/to/draft", "num_speculative_tokens": 3}            # method "draft_model"
    {"proposer": MyProposer(), "num_speculative_tokens": 3}           # method "custom" (minivllm's)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "proposer"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "custom"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model's checkpoint folder (method "draft_model")
    proposer: Any = None  # a Proposer instance (method "custom")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - _KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; minivllm supports "
                             f"{sorted(_KEYS)}")
        method = d.get("method") or ("draft_model" if d.get("model") else "custom" if d.get("proposer") else None)
        if method not in ("ngram", "draft_model", "custom"):
            raise ValueError(f"speculative_config.method={method!r}: use 'ngram', or give 'model' (a draft "
                             "model folder) or 'proposer' (a minivllm Proposer)")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r}: give an integer in [1, 16]")
        cfg = cls(method, k, int(d.get("prompt_lookup_max", 4)), int(d.get("prompt_lookup_min", 1)),
                  d.get("model"), d.get("proposer"))
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint folder)")
        if method == "custom" and cfg.proposer is None:
            raise ValueError("speculative_config: give 'proposer', a minivllm.engine.spec_decode.Proposer")
        return cfg
