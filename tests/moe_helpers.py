"""Tiny random Qwen3-MoE / Qwen2-MoE checkpoints for the tests (no real MoE checkpoint is reachable offline).

    path = tiny_moe_checkpoint(tmp_path, family="qwen3_moe")          # or "qwen2_moe" (a shared expert)
    path = tiny_moe_checkpoint(tmp_path, layout="fused", config_keys="transformers4", norm_topk_prob=False)
    hf = hf_moe_model(path)                                            # HF's model, fp32, eval

Saved by HF's own `save_pretrained` (config.json, model.safetensors with per-expert keys, which is what
transformers 5 writes), beside the byte-level tokenizer of minivllm.teaching.checkpoints, so the engine
loads it exactly as a downloaded model. Two rewrites give the other forms a checkpoint may take:
  layout="fused"                    the experts as transformers 5 holds them in memory: one
                                    `experts.gate_up_proj` (E, 2I, H) and one `experts.down_proj` (E, H, I)
  config_keys="transformers4"       "torch_dtype", "rope_theta", "num_experts" (not "dtype",
                                    "rope_parameters", "num_local_experts")
Default sizes: 8 experts of width 32, 2 per token, hidden 64, 2 layers; any config field can be overridden.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from minivllm.teaching.checkpoints import make_tokenizer

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(head_dim=16, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=48)),
}


def tiny_moe_checkpoint(path: str | Path, family: str = "qwen3_moe", *, layout: str = "per_expert",
                        config_keys: str = "transformers5", seed: int = 0, **overrides) -> Path:
    """Build, save and return a tiny random `family` checkpoint in folder `path` (see the module docstring)."""
    path = Path(path)
    config_cls, arch, defaults = FAMILIES[family]
    tokenizer = make_tokenizer(384)
    config = config_cls(**{
        **dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None, pad_token_id=tokenizer.pad_token_id),
        **defaults, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits (and router choices) are not near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    if layout == "fused":
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers' in-memory form changed"
        for f in path.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif layout != "per_expert":
        raise ValueError(f"layout={layout!r}: 'per_expert' or 'fused'")
    if config_keys == "transformers4":
        _as_transformers4_config(path / "config.json")
    elif config_keys != "transformers5":
        raise ValueError(f"config_keys={config_keys!r}: 'transformers5' or 'transformers4'")
    return path


def _as_transformers4_config(config_json: Path) -> None:
    cfg = json.loads(config_json.read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    config_json.write_text(json.dumps(cfg, indent=2))


def hf_moe_model(path: str | Path):
    """HF transformers' model of a tiny checkpoint (per-expert layout), fp32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
