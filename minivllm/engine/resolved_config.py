"""`ResolvedConfig`: every option the engine runs with, decided once, in one place, then frozen.

`EngineConfig` holds what the user asked (with "auto" and None meaning "you choose"); `resolve_config`
turns it into what this engine will do, with the checkpoint and the machine at hand:

    device              "auto": CUDA when available, else CPU                  (loading.resolve_device)
    dtype               "auto": the checkpoint's on CUDA; on CPU bf16 for a 16-bit checkpoint on any
                        AVX2+FMA CPU with the kernels built, or native bf16    (loading.resolve_dtype)
    max_model_len       None: the model's max_position_embeddings (and the token budget without chunked
                        prefill); a larger value is refused with what to lower
    prefix caching      a hybrid model's needs its state cache (`StateCacheConfig`: stride, snapshots,
                        bytes; engine/core/state_cache.py), sized here with a line saying what it reserves
    speculative_config  parsed and checked (`SpeculativeConfig`); a hybrid model's state pool keeps a
                        candidate state per draft (engine/core/state_pool.py)
    eos_token_ids       the checkpoint's and the tokenizer's
    reasoning           the reasoning parser's think-token ids, found in the tokenizer (refused without them)
    batch_invariant     refused where "auto" chose CUDA, and for a hybrid model (its chunked linear
                        attention sums in an order set by the chunking)

Nothing else in the engine re-derives an option: every component reads the resolved one.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.request.state_layout import StateCacheConfig, resolve_state_cache
from minivllm.engine.spec_decode.config import SpeculativeConfig
from minivllm.engine.worker.loading import resolve_device, resolve_dtype
from minivllm.models.hf_config import ModelSpec
from minivllm.reasoning import ReasoningConfig


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # max_model_len set; enable_prefix_caching as it will be
    spec: ModelSpec  # the checkpoint's model
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    speculative: SpeculativeConfig | None
    state_cache: StateCacheConfig | None = None  # a hybrid model with prefix caching: its state snapshots
    reasoning: ReasoningConfig | None = None  # the reasoning parser and its think tokens (None: no parser)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


def resolve_config(config: EngineConfig, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> ResolvedConfig:
    tokenizer_eos_token_id = tokenizer.eos_token_id
    reasoning = (ReasoningConfig.from_tokenizer(config.reasoning_parser, tokenizer)
                 if config.reasoning_parser is not None else None)  # before any weight is loaded
    device = resolve_device(config)
    dtype = resolve_dtype(config, spec, device)
    _check_batch_invariant(config, spec, device)
    _say_dtype(config, spec, device, dtype)
    eos = set(spec.eos_token_ids)
    if tokenizer_eos_token_id is not None:
        eos.add(tokenizer_eos_token_id)
    config = _limits(config, spec)
    speculative = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config is not None else None
    state_cache = None
    if spec.linear_attn is not None and config.enable_prefix_caching:
        state_cache = resolve_state_cache(config, spec, dtype)
    return ResolvedConfig(config, spec, device, dtype, frozenset(eos), speculative, state_cache, reasoning)


def _say_dtype(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
    chosen = (f"minivllm: dtype {str(dtype).removeprefix('torch.')} (dtype={config.dtype!r}, checkpoint "
              f"{spec.dtype}, {device.type}), quantization {config.quantization}")
    # Said on stderr when the machine made the choice (auto picked other than the checkpoint's).
    machine_choice = config.dtype == "auto" and str(dtype).removeprefix("torch.") != str(spec.dtype)
    if machine_choice or config.quantization:
        print(chosen, file=sys.stderr)
    else:
        logging.getLogger("minivllm").info(chosen)


def _check_batch_invariant(config: EngineConfig, spec: ModelSpec, device: torch.device) -> None:
    """What `EngineConfig` could not know: the device "auto" chose, and the checkpoint's layers."""
    if not config.batch_invariant:
        return
    if device.type != "cpu":
        raise ValueError(f"batch_invariant=True on {device} (device={config.device!r}): the mode is not yet verified "
                         "on a GPU (split-KV counts and CUDA graphs vary with the batch); pass device='cpu', or "
                         "batch_invariant=False")
    if spec.sliding_window is not None:
        raise ValueError(f"batch_invariant=True with {spec.architecture}: its sliding-window layers are not in the "
                         "per-row attention of that mode; use a Llama, Qwen2 or Qwen3 model, or batch_invariant=False")
    if spec.linear_attn is not None:
        raise ValueError(f"batch_invariant=True with {spec.architecture}: its linear-attention layers run the chunked "
                         "gated delta rule, whose sums depend on how the prompt was chunked; use a Llama, Qwen2 or "
                         "Qwen3 model, or batch_invariant=False")


def _limits(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
    limit = spec.max_position_embeddings
    if not config.enable_chunked_prefill:
        limit = min(limit, config.max_num_batched_tokens)
    if config.max_model_len is None:
        return config.replace(max_model_len=limit)
    if config.max_model_len > limit:
        also = "" if config.enable_chunked_prefill else ", or max_num_batched_tokens with chunked prefill off"
        raise ValueError(f"max_model_len={config.max_model_len} exceeds {limit} (the model's "
                         f"max_position_embeddings{also}); lower max_model_len")
    return config
