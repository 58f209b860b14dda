"""Model registry: `architectures` in config.json -> the class that implements it.

Qwen2 and Qwen3 are the Llama decoder with one switch each (see `models/llama.py`), so all three
names map to the same class; `ModelSpec` carries the switches.

Qwen3.5 is a hybrid (gated-DeltaNet linear attention + full attention, `models/qwen3_5.py`); its
multimodal checkpoints (`...ForConditionalGeneration`) load their text decoder only.

Gemma 3 mixes sliding-window and full-attention layers (`models/gemma3.py`); the engine gives each
kind its own KV-cache group (engine/core/kv_cache_groups.py). Its multimodal form loads the text decoder too.

Qwen3-MoE and Qwen2-MoE are the Llama decoder with a mixture of experts in place of the MLP
(`models/qwen3_moe.py`): one class, the families' differences are switches of `ModelSpec` again.
"""

from minivllm.models.gemma3 import Gemma3ForCausalLM
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + q/k/v bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k RMSNorm
    "MistralForCausalLM": LlamaForCausalLM,  # the Llama decoder (a checkpoint without a sliding window)
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # hybrid: needs the engine's state pool
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its model.language_model part
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # sliding-window + full layers: two KV-cache groups
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model part
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,  # experts in place of the MLP
    "Qwen2MoeForCausalLM": Qwen3MoeForCausalLM,  # + q/k/v bias, a shared expert, no q/k norm
}

__all__ = ["MODEL_REGISTRY", "Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen3_5ForCausalLM", "Qwen3MoeForCausalLM"]
