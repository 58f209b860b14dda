"""`SpeculativeConfig`: vLLM's `speculative_config` dict, parsed and validated once.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "path/to/draft", "num_speculative_tokens": 3}            # method "draft_model"
    {"proposer": MyProposer(), "num_speculative_tokens": 3}           # method "custom" (minivllm's)

Below the engine, beside `EngineConfig` (minivllm/config.py), which parses the dict when it is built, so
a wrong option fails at `LLM(...)` before any weight is read, and refuses what the method cannot be
combined with (a draft model with an attention backend of your own). The engine's speculative decoding
(engine/spec_decode/) reads the parsed form, importing it down as it imports the config (by the path
engine/spec_decode/config.py, which imports it from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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
        def integer(key: str, default: int | None, lo: int, hi: int) -> int:
            value = d.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"speculative_config.{key}={value!r}: give an integer in [{lo}, {hi}]")
            return value

        k = integer("num_speculative_tokens", None, 1, 16)
        lookup_max, lookup_min = integer("prompt_lookup_max", 4, 1, 64), integer("prompt_lookup_min", 1, 1, 64)
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model={model!r}: give the draft model's checkpoint folder")
        cfg = cls(method, k, lookup_max, lookup_min, model, d.get("proposer"))
        if not cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={lookup_min} exceeds prompt_lookup_max="
                             f"{lookup_max}; need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint folder)")
        if cfg.model and not Path(cfg.model).is_dir():
            raise ValueError(f"speculative_config.model={cfg.model!r} is not a folder: give the draft model's "
                             "checkpoint folder (config.json, *.safetensors and the tokenizer)")
        if method == "custom" and cfg.proposer is None:
            raise ValueError("speculative_config: give 'proposer', a minivllm.engine.spec_decode.Proposer")
        return cfg
