"""Model registry: `architectures` in config.json -> the class that implements it.

Qwen2 and Qwen3 are the Llama decoder with one switch each (see `models/llama.py`), so all three
names map to the same class; `ModelSpec` carries the switches.

Qwen3.5 is a hybrid (gated-DeltaNet linear attention + full attention, `models/qwen3_5.py`); its
multimodal checkpoints (`...ForConditionalGeneration`) load their text decoder only.
"""

from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + q/k/v bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k RMSNorm
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # hybrid: needs the engine's state pool
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its model.language_model part
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "Qwen3_5ForCausalLM"]
