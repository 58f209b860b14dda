"""`ModelSpec`: the numbers of a checkpoint's `config.json`, in one typed, frozen record.

Both generations of transformers' config keys are accepted:
  transformers 4:  "torch_dtype", "rope_theta", "rope_scaling": {"rope_type" | "type": ...}
  transformers 5:  "dtype", "rope_parameters": {"rope_type": ..., "rope_theta": ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama if configured)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    rope: RopeSpec
    dtype: str | None  # the checkpoint's dtype, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope_from(cfg: dict[str, Any]) -> RopeSpec:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; minivllm supports {SUPPORTED_ROPE_TYPES}")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_model_spec(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unknown architecture {archs or '(none given)'} in config.json; "
                         f"minivllm supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = _ids(cfg.get("eos_token_id")) + _ids((generation_cfg or {}).get("eos_token_id"))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        rope=_rope_from(cfg),
        dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        hidden_act=act,
    )


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: pass a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e
    gen_path = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_spec(cfg, gen)
