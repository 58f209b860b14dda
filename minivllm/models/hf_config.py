"""`ModelSpec`: the numbers of a checkpoint's `config.json`, in one typed, frozen record.

Both generations of transformers' config keys are accepted:
  transformers 4:  "torch_dtype", "rope_theta", "rope_scaling": {"rope_type" | "type": ...}
  transformers 5:  "dtype", "rope_parameters": {"rope_type": ..., "rope_theta": ...}

Hybrid checkpoints (Qwen3.5) add `layer_types` and the gated-DeltaNet numbers (`LinearAttnSpec`); their
multimodal form (`Qwen3_5ForConditionalGeneration`) nests the decoder's keys under "text_config".

Gemma 3 (`Gemma3ForCausalLM`, and the text decoder of `Gemma3ForConditionalGeneration`) mixes
sliding-window layers ("sliding_attention", window `sliding_window`) with full ones, 5 : 1 by default
(`sliding_window_pattern`, or `layer_types`). The two kinds rotate with different RoPE bases:
  transformers 4:  "rope_theta" (full layers, with "rope_scaling"), "rope_local_base_freq" (sliding)
  transformers 5:  "rope_parameters": {"full_attention": {...}, "sliding_attention": {...}}
Soft-capping (Gemma 2's `attn_logit_softcapping`, `final_logit_softcapping`) is refused by name.
`MistralForCausalLM` is the Llama decoder; one with a `sliding_window` (every layer sliding) is refused.

Mixture-of-experts checkpoints (Qwen3-MoE: Qwen3's attention; Qwen2-MoE: Qwen2's, its q/k/v bias under
"qkv_bias", plus a shared expert) add `moe`, parsed in models/moe_config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minivllm.layers.rotary import RopeSpec
from minivllm.models.moe_config import MOE_ARCHITECTURES, MoeSpec, parse_moe_spec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Gated-DeltaNet (linear attention) layers interleaved with full attention: models/qwen3_5.py, run with
# the engine's per-request state pool (engine/core/state_pool.py).
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
LAYER_TYPES = ("full_attention", "linear_attention")
# Sliding-window layers beside full ones (models/gemma3.py), each kind with its KV-cache group
# (engine/core/kv_cache_groups.py).
SLIDING_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
SLIDING_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LinearAttnSpec:
    """The gated-DeltaNet layers' sizes (config keys `linear_*`); see layers/gated_deltanet.py."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: q/k head h serves v heads h*G .. h*G+G-1
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the short conv runs over q | k | v
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:  # per request, per layer
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:  # per request, per layer
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


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
    o_proj_bias: bool = False  # bias on o_proj too: Llama and Qwen3 with attention_bias (Qwen2 never has it)
    # Hybrid models (Qwen3.5); the defaults describe a plain decoder.
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; () means all full attention
    linear_attn: LinearAttnSpec | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: o = attention * sigmoid(gate)
    # Gemma 3: layers of `layer_types` "sliding_attention" see the last `sliding_window` keys (themselves
    # included) and rotate with `local_rope`; q is scaled by query_pre_attn_scalar ** -0.5.
    sliding_window: int | None = None
    local_rope: RopeSpec | None = None
    query_pre_attn_scalar: float | None = None
    moe: MoeSpec | None = None  # mixture of experts (models/qwen3_moe.py); None: every layer's MLP is dense

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def q_proj_size(self) -> int:  # q_proj's rows: with an output gate, [q_h | gate_h] for every head h
        return self.q_size * (2 if self.attn_output_gate else 1)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:  # the layers that own a slice of the KV cache
        return tuple(i for i in range(self.num_hidden_layers)
                     if not self.layer_types or self.layer_types[i] == "full_attention")

    @property
    def sliding_attention_layers(self) -> tuple[int, ...]:  # the layers of the sliding-window KV-cache group
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:  # every layer with a KV cache, full or sliding
        return tuple(sorted(self.full_attention_layers + self.sliding_attention_layers))

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:  # the layers that own a state-pool slot
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope_from(cfg: dict[str, Any]) -> RopeSpec:
    return _rope_spec(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 10000.0))


def _rope_spec(params: dict[str, Any], default_theta: float) -> RopeSpec:
    theta = params.get("rope_theta", default_theta)
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
    known = SUPPORTED_ARCHITECTURES + HYBRID_ARCHITECTURES + SLIDING_ARCHITECTURES + MOE_ARCHITECTURES
    arch = next((a for a in archs if a in known), None)
    if arch is None:
        raise ValueError(f"unknown architecture {archs or '(none given)'} in config.json; "
                         f"minivllm supports {', '.join(known)}")
    if arch in HYBRID_ARCHITECTURES + SLIDING_ARCHITECTURES and "text_config" in cfg:  # multimodal: the
        # decoder's keys are nested; HF ties the LM head by the top-level flag
        tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", arch.startswith("Gemma")))
        cfg = {**cfg, **cfg["text_config"], "tie_word_embeddings": tie}
    if cfg.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    if arch == "MistralForCausalLM" and cfg.get("sliding_window") is not None:
        # every layer would slide: the KV-cache groups need a full-attention group (engine/core/kv_cache_groups.py)
        raise ValueError(f"MistralForCausalLM with sliding_window={cfg['sliding_window']} is not supported (every "
                         "layer slides); Mistral checkpoints with sliding_window null run as the Llama decoder")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if arch in SLIDING_ARCHITECTURES else "silu"):
        raise ValueError(f"hidden_act={act!r} is not supported for {arch} (only "
                         f"{'gelu_pytorch_tanh' if arch in SLIDING_ARCHITECTURES else 'silu'})")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = _ids(cfg.get("eos_token_id")) + _ids((generation_cfg or {}).get("eos_token_id"))
    spec = ModelSpec(
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
        o_proj_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
    )
    if arch in SLIDING_ARCHITECTURES:
        return _with_sliding_fields(spec, cfg)
    if arch in MOE_ARCHITECTURES:  # Qwen3-MoE: Qwen3's q/k norms; Qwen2-MoE: Qwen2's q/k/v bias ("qkv_bias")
        qwen2 = arch == "Qwen2MoeForCausalLM"
        return replace(spec, moe=parse_moe_spec(arch, cfg, spec.num_hidden_layers), qk_norm=not qwen2,
                       attention_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else spec.attention_bias,
                       o_proj_bias=spec.o_proj_bias and not qwen2)
    return _with_hybrid_fields(spec, cfg) if arch in HYBRID_ARCHITECTURES else spec


def _with_sliding_fields(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    """Gemma 3: which layers slide, the window, both RoPE settings, q's scale and per-head q/k norms."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{key}={cfg[key]} is not supported (tanh soft-capping of logits); minivllm runs "
                             f"Gemma 3 checkpoints, whose {key} is null")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (a decoder attends causally)")
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be a positive integer for {spec.architecture}")
    pattern = int(cfg.get("sliding_window_pattern", 6))
    layer_types = tuple(cfg.get("layer_types") or (
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(spec.num_hidden_layers)))
    if len(layer_types) != spec.num_hidden_layers or not set(layer_types) <= set(SLIDING_LAYER_TYPES):
        raise ValueError(f"layer_types {list(layer_types)} must give one of {SLIDING_LAYER_TYPES} for each of the "
                         f"{spec.num_hidden_layers} layers; config.json is inconsistent")
    if "full_attention" not in layer_types:
        raise ValueError("every layer is sliding_attention: minivllm needs at least one full-attention layer "
                         "(its KV-cache group holds the prefix cache's whole prompts)")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one dict per layer type
        rope = _rope_spec(params.get("full_attention") or {}, 1_000_000.0)
        local = _rope_spec(params.get("sliding_attention") or {}, 10_000.0)
    else:  # transformers 4: rope_scaling applies to the full layers only
        rope = _rope_spec(cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 1_000_000.0))
        local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
    if local.rope_type != "default":
        raise ValueError(f"RoPE type {local.rope_type!r} on the sliding layers is not supported (Gemma 3 scales "
                         "only its full-attention layers)")
    if "sliding_attention" not in layer_types:  # no layer slides: one KV-cache group, the window unused
        window = None
    return replace(spec, qk_norm=True, layer_types=layer_types, sliding_window=window, rope=rope, local_rope=local,
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                   head_dim=int(cfg.get("head_dim") or 256))


def _with_hybrid_fields(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    """Qwen3.5: every `full_attention_interval`-th layer is full attention (unless `layer_types` lists
    them), the rest gated DeltaNet. Its attention always has the output gate and per-head q/k norms
    (HF's Qwen3_5Attention has no switch for either) and rotates a quarter of each head by default.
    The checkpoint's M-RoPE sections ("mrope_section") are ignored: for text, the three position
    streams are equal and M-RoPE is plain RoPE."""
    interval = int(cfg.get("full_attention_interval", 4))
    layer_types = tuple(cfg.get("layer_types") or (
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(spec.num_hidden_layers)))
    if len(layer_types) != spec.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types {list(layer_types)} must give one of {LAYER_TYPES} for each of the "
                         f"{spec.num_hidden_layers} layers; config.json is inconsistent")
    rope = cfg.get("rope_parameters") or {}
    return replace(
        spec, qk_norm=True, attn_output_gate=True, layer_types=layer_types,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        linear_attn=LinearAttnSpec(
            num_k_heads=int(cfg["linear_num_key_heads"]), num_v_heads=int(cfg["linear_num_value_heads"]),
            head_k_dim=int(cfg["linear_key_head_dim"]), head_v_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel_size=int(cfg.get("linear_conv_kernel_dim", 4))),
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
