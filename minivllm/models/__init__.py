"""Model registry: `architectures` in config.json -> the class that implements it.

Qwen2 and Qwen3 are the Llama decoder with one switch each (see `models/llama.py`), so all three
names map to the same class; `ModelSpec` carries the switches.
"""

from minivllm.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + q/k/v bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k RMSNorm
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
