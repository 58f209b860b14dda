"""Tiny random Qwen3-MoE / Qwen2-MoE checkpoints for the tests (no real MoE checkpoint is reachable offline).

    path = tiny_moe_checkpoint(tmp_path, family="qwen3_moe")          # or "qwen2_moe" (a shared expert)
    path = tiny_moe_checkpoint(tmp_path, layout="fused", config_keys="transformers4", norm_topk_prob=False)
    hf = hf_moe_model(path)                                            # HF's model, fp32, eval

Built by minivllm.teaching.tiny_moe (the notebook's checkpoints), saved by HF's own `save_pretrained`
(config.json, model.safetensors with per-expert keys, which is what transformers 5 writes), beside the
byte-level tokenizer of minivllm.teaching.checkpoints, so the engine loads it exactly as a downloaded model.
Two rewrites give the other forms a checkpoint may take:
  layout="fused"                    the experts as transformers 5 holds them in memory: one
                                    `experts.gate_up_proj` (E, 2I, H) and one `experts.down_proj` (E, H, I)
  config_keys="transformers4"       "torch_dtype", "rope_theta", "num_experts" (not "dtype",
                                    "rope_parameters", "num_local_experts")
Default sizes: 8 experts of width 32, 2 per token, hidden 64, 2 layers; any config field can be overridden.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from minivllm.teaching.tiny_moe import load_hf_model, make_tiny_moe_model


def tiny_moe_checkpoint(path: str | Path, family: str = "qwen3_moe", *, layout: str = "per_expert",
                        config_keys: str = "transformers5", seed: int = 0, **overrides) -> Path:
    """Build, save and return a tiny random `family` checkpoint in folder `path` (see the module docstring):
    teaching/tiny_moe.py's checkpoint (the notebook's), in the layout and config keys asked."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout={layout!r}: 'per_expert' or 'fused'")
    if config_keys not in ("transformers5", "transformers4"):
        raise ValueError(f"config_keys={config_keys!r}: 'transformers5' or 'transformers4'")
    path = make_tiny_moe_model(path, family, seed=seed, **overrides)
    if layout == "fused":  # what transformers 5 holds in memory: each layer's experts as two 3-D tensors
        state = {k: v.contiguous() for k, v in load_hf_model(path).state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers' in-memory form changed"
        for f in path.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config_keys == "transformers4":
        _as_transformers4_config(path / "config.json")
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


hf_moe_model = load_hf_model  # HF transformers' model of a tiny checkpoint, fp32, eval mode
