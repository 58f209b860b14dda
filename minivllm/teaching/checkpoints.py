"""Tiny random checkpoints, built offline in a folder: what the notebooks, the tests and the
benchmarks run the engine on.

    model_dir = make_tiny_model(tempfile.mkdtemp(), "qwen3")      # then LLM(str(model_dir))
    hf = load_hf_model(model_dir)                                  # HF transformers' model of it, fp32, eval

A seeded `Qwen3Config` / `Qwen2Config` / `LlamaConfig` / `Qwen3_5TextConfig` (hybrid) / `Gemma3TextConfig`
(sliding-window layers) model is saved
with `save_pretrained`, exactly as a real checkpoint is (config.json, model.safetensors), next to a
small byte-level BPE tokenizer trained with `tokenizers` on a few sentences, and a chat template. The
engine loads it through the same path as a downloaded model.
Random weights say nothing about language: a tiny model is for watching the engine's machinery at
work in a second, for checking it against HF transformers, and for timing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3Config)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler decides which requests run in each step of the engine.",
    "Continuous batching lets new requests join while others decode.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = {
    "qwen3": (Qwen3Config, dict(head_dim=16)),
    "qwen2": (Qwen2Config, dict()),
    "llama": (LlamaConfig, dict()),
    "mistral": (MistralConfig, dict(sliding_window=None)),  # Llama's decoder; a window would slide every layer
}
ARCHITECTURES = {"qwen3_5": "Qwen3_5ForCausalLM"}  # where the config class's name does not give it
try:  # Qwen3.5 is in transformers 5 only (Feb 2026); older versions simply have no "qwen3_5" family
    from transformers import Qwen3_5TextConfig

    # hybrid: with the default 2 layers, [linear_attention, full_attention]; Hv = 2 Hk and Dv != Dk
    FAMILIES["qwen3_5"] = (Qwen3_5TextConfig, dict(
        head_dim=16, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8))
except ImportError:
    pass
try:  # Gemma 3 (transformers >= 4.50): 5 sliding-window layers to 1 full by default; a tiny window here
    from transformers import Gemma3TextConfig

    FAMILIES["gemma3"] = (Gemma3TextConfig, dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                                 layer_types=None, sliding_window_pattern=2))
    ARCHITECTURES["gemma3"] = "Gemma3ForCausalLM"
except ImportError:
    pass


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: str | Path, family: str = "qwen3", *, vocab_size: int = 384, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    tie_word_embeddings: bool = False, seed: int = 0, rope_scaling: dict | None = None,
                    max_position_embeddings: int = 512, **extra) -> Path:
    path = Path(path)
    config_cls, defaults = FAMILIES[family]
    tokenizer = make_tokenizer(vocab_size)
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings,
                  max_position_embeddings=max_position_embeddings, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=None, pad_token_id=tokenizer.pad_token_id, **{**defaults, **extra})
    if rope_scaling is not None:
        kwargs["rope_parameters"] = rope_scaling
    config = config_cls(**kwargs)
    config.architectures = [ARCHITECTURES.get(family, config_cls.__name__.replace("Config", "ForCausalLM"))]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-ties
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            if family == "gemma3" and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # its norms scale by 1 + w: w = 0 would test nothing
            if family == "qwen3_5" and name.endswith(("conv1d.weight", "norm.weight")):
                # conv taps and norm scales too (the gated norm's weight is used as is, the others as 1 + w)
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.3)
    return save_quietly(model, tokenizer, path)


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside, as they were after: "Writing model shards" and "Loading weights"
    would print bars into notebooks, tests and graders' output."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def save_quietly(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """`save_pretrained` of a model and its tokenizer into `path`, without progress bars; returns `path`."""
    with quiet_progress_bars():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def load_hf_model(path: str | Path) -> PreTrainedModel:
    """HF transformers' model of a checkpoint folder (dense or MoE), fp32, eval mode, without progress bars:
    the reference the notebooks, graders and tests check the engine's tokens against."""
    with quiet_progress_bars():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
