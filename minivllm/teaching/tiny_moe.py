"""Tiny random mixture-of-experts checkpoints, and a real one's shape without its weights (notebook 18).

    model_dir = make_tiny_moe_model(tempfile.mkdtemp())               # then LLM(str(model_dir))
    model_dir = make_tiny_moe_model(d, "qwen2_moe", num_experts=4)    # Qwen2-MoE: with a shared expert
    hf = load_hf_model(model_dir)       # HF transformers' model of it, fp32, eval (teaching/checkpoints.py's)
    spec = qwen3_30b_a3b_spec()                                       # Qwen3-30B-A3B's ModelSpec, no weights

No real MoE checkpoint is reachable offline (Qwen3-30B-A3B, the smallest Qwen3-MoE, is 61 GB in bf16), so the
notebook and the course run the engine on a seeded random `Qwen3MoeConfig` / `Qwen2MoeConfig` model saved
with `save_pretrained`, exactly as a downloaded checkpoint is (config.json, model.safetensors with one key
per expert, as transformers 5 writes them), beside the byte-level tokenizer of teaching/checkpoints.py.
The engine loads it through the same path as a real model, and HF transformers loads the same folder:
that is how the notebook checks the engine's tokens against HF's.

Random weights are widened from HF's tiny initialisation (std 0.02) to 0.08, as make_tiny_model does, so
the router's logits are far apart: with HF's own init every token's k experts would be near-ties, and a
last-bit difference between two implementations could pick another expert.

What a real model's size means for a decode step does not need its weights, only its shapes:
`qwen3_30b_a3b_spec()` parses the published config.json numbers of Qwen3-30B-A3B with the engine's own
`parse_model_spec`, and teaching/moe_viz.py builds the model from it on the meta device to count bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from minivllm.models.hf_config import ModelSpec, parse_model_spec
from minivllm.teaching.checkpoints import load_hf_model, make_tokenizer, save_quietly

__all__ = ["FAMILIES", "QWEN3_30B_A3B", "load_hf_model", "make_tiny_moe_model", "qwen3_30b_a3b_spec"]

FAMILIES = {  # family: (config class, architecture, what differs from the shared defaults)
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(head_dim=16, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=48)),
}

# Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B): 48 layers, all sparse, 128 experts of
# width 768, 8 a token, renormalized; 32 query heads and 4 KV heads of 128. 30.5 B weights, 3.3 B active.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)


def make_tiny_moe_model(path: str | Path, family: str = "qwen3_moe", *, vocab_size: int = 384,
                        hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                        num_experts: int = 8, top_k: int = 2, moe_intermediate_size: int = 32,
                        intermediate_size: int = 96, seed: int = 0, **extra: Any) -> Path:
    """Build, save and return a tiny random `family` checkpoint in folder `path`. `extra`: any other
    field of the config class (norm_topk_prob, decoder_sparse_step, mlp_only_layers, ...)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: one of {sorted(FAMILIES)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: each token picks between 1 and num_experts={num_experts} experts")
    path = Path(path)
    config_cls, architecture, defaults = FAMILIES[family]
    tokenizer = make_tokenizer(vocab_size)
    config = config_cls(**{
        **dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
               num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
               moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
               max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None, pad_token_id=tokenizer.pad_token_id),
        **defaults, **extra})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # widen the random init: logits and router choices far from ties (the docstring)
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # transformers 5 holds each layer's experts as one 3-D tensor
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    return save_quietly(model, tokenizer, path)


def qwen3_30b_a3b_spec() -> ModelSpec:
    """Qwen3-30B-A3B's `ModelSpec`, parsed from its config.json numbers: its shapes, no weights."""
    config = Qwen3MoeConfig(**QWEN3_30B_A3B)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return parse_model_spec(config.to_dict(), None)
