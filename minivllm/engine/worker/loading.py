"""Start-up: pick device and dtype, build the model from a checkpoint folder, size the KV pool.

Defaults: device "auto" is CUDA when available, else CPU. dtype "auto" is the checkpoint's dtype on
CUDA (bfloat16 if it names none); on CPU bfloat16 for a 16-bit checkpoint on every x86-64-v3 CPU
(AVX2 + FMA) where minivllm's CPU kernels are built, and where the CPU computes bf16 in hardware (AMX or
avx512_bf16); float32 otherwise (`resolve_dtype`).

`load_rank` is what every rank runs at start-up, rank 0 (the engine) and each tensor-parallel
worker alike, in the same order, because its last steps are collectives: build this rank's shard of
the model, agree with the other ranks on the KV pool's size, pick the attention backend for this
rank's heads (or check the caller's `AttentionBackend` instance against them: one rank only). With one
rank it is simply "build the model, size the pool".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from minivllm.config import EngineConfig
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.engine.worker.kv_cache import num_kv_blocks_for
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.layers.attention import AttentionBackend, get_attention_backend
from minivllm.layers.batch_invariance import set_batch_invariant_methods
from minivllm.layers.per_row_attention import PerRowAttentionBackend
from minivllm.layers.quantization import quantize_model
from minivllm.models import MODEL_REGISTRY
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.models.loader import load_weights
from minivllm.models.sharding import ShardLayout

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but CUDA is not available; use device='cpu'")
    return device


def resolve_dtype(config: EngineConfig, spec: ModelSpec, device: torch.device,
                  cpu: CpuInfo | None = None, kernels_built: bool | None = None) -> torch.dtype:
    """dtype "auto": on CUDA the checkpoint's dtype (bfloat16 if it names none). On CPU, for a 16-bit
    checkpoint (bf16 or fp16, the default model's GGUF included), bfloat16 where a kernel reads bf16
    weights fast: every x86-64-v3 CPU (`cpu.x86_64_v3`, default: this one, at minivllm's ISA level) with
    minivllm's CPU kernels built (`kernels_built`, default: `load_cpu_kernels().available`), and every CPU
    that computes bf16 in hardware (AMX, avx512_bf16); float32 elsewhere, and for an fp32 checkpoint
    (the tests' tiny models keep their precision).
    Why: decode is bound by the bytes it reads, and the skinny kernel widens a bf16 weight to fp32 with a
    shift in registers, so bf16 streams half the bytes without hardware bf16 (Zen 3, 1 row: 19.6 tok/s
    against 15.0 in fp32). Products of many rows, where oneDNN takes no bf16, are widened to fp32 for
    MKL's GEMM (cpu/matmul_forms.py WIDENED). Without the kernels nothing reads bf16 fast: float32."""
    if config.dtype != "auto":
        return _TORCH_DTYPES[config.dtype]
    checkpoint = _TORCH_DTYPES.get(str(spec.dtype).removeprefix("torch."))
    if device.type != "cpu":
        return checkpoint or torch.bfloat16
    if checkpoint not in (torch.float16, torch.bfloat16):  # fp16 too (bf16 here): CPUs compute bf16, not fp16
        return torch.float32
    cpu = cpu or CpuInfo.read()
    if cpu.native_bf16:
        return torch.bfloat16
    # the CPU first: where it is not x86-64-v3, no kernel build is attempted (a compile takes minutes)
    reads_bf16 = cpu.x86_64_v3 and (load_cpu_kernels().available if kernels_built is None else kernels_built)
    return torch.bfloat16 if reads_bf16 else torch.float32


def build_model(spec: ModelSpec, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                max_position: int, tp: ParallelContext | None = None, batch_invariant: bool = False) -> CausalLM:
    """Create the model without initialising weights (meta device), then fill it from disk; with `tp`
    of several ranks, only this rank's shard (the Llama decoder and its MoE form are sharded: models/sharding.py).
    `batch_invariant`: its linear layers and experts multiply in fixed tiles (layers/batch_invariance.py)."""
    sharded = tp is not None and tp.world_size > 1
    with torch.device("meta"):
        model_cls = MODEL_REGISTRY[spec.architecture]
        model = model_cls(spec, tp) if sharded else model_cls(spec)
    if batch_invariant:  # one rank (EngineConfig refuses tensor parallelism with it)
        set_batch_invariant_methods(model)  # tiled matmuls, a mixture of experts' too
    model = materialize(model, device, dtype)
    load_weights(model, spec, model_dir, ShardLayout.of(spec, tp.rank, tp.world_size) if sharded else None)
    model.init_rotary(max_position, device)
    return model.eval()


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Give a model built on the meta device real, uninitialised memory on `device`, floating-point tensors in
    `dtype` (the loader fills them next). What `model.to(dtype).to_empty(device=device)` does, without its
    route through torch's meta reference ops, whose first use imports sympy (~0.7 s of a start on 2 cores),
    and without fp32 memory converted afterwards. A tensor shared by two modules (tied embeddings) stays
    shared."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, kept alive; its real one)

    def real(meta: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(meta) not in made:
            x = torch.empty(meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype, device=device)
            made[id(meta)] = (meta, nn.Parameter(x, meta.requires_grad) if parameter else x)
        return made[id(meta)][1]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = real(param, parameter=True)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = real(buffer, parameter=False)
    return model


class RankModel(NamedTuple):
    """What one rank runs."""

    model: CausalLM
    spec: ModelSpec  # the model as this rank sees it: its heads, its share of the MLP (models/sharding.py)
    num_blocks: int  # the KV pool's size, the same on every rank
    backend: AttentionBackend
    num_sliding_blocks: int = 0  # the sliding-window layers' pool (engine/core/kv_cache_groups.py); 0: none


def load_rank(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
              tp: ParallelContext) -> RankModel:
    """This rank's model, KV pool size and attention backend (`config.max_model_len` resolved)."""
    model = build_model(spec, config.model, device, dtype, config.max_model_len, tp, config.batch_invariant)
    if config.quantization is not None:  # after loading: the checkpoint's weights are quantized here
        quantized = quantize_model(model, config.quantization, device, reduce_range=not CpuInfo.read().vnni)
        print(quantized.summary(dtype), file=sys.stderr)  # beside resolved_config's "quantization int8" line
    if compile_decision(model, config, device)[0]:
        model.compile_forward(config.compile_sizes)  # compiled lazily, size by size (at warm-up)
    rank_spec = ShardLayout.of(spec, tp.rank, tp.world_size).rank_spec(spec)  # `spec` itself on one rank
    # Each rank sizes the pool from its own free memory; the smallest wins (a collective).
    pools = num_kv_blocks_for(config, rank_spec, device, dtype)  # a sliding pool: one rank only (sharding.py)
    num_blocks = tp.min_over_ranks(pools.num_blocks)
    if config.batch_invariant:  # every row a one-row query over its own context
        backend: AttentionBackend = PerRowAttentionBackend(rank_spec.num_attention_heads,
                                                           rank_spec.num_key_value_heads, rank_spec.head_dim, dtype)
    else:
        backend = get_attention_backend(config.attention_backend, device, rank_spec.num_attention_heads,
                                        rank_spec.num_key_value_heads, rank_spec.head_dim, config.block_size)
    if spec.sliding_window is not None and not backend.supports_sliding_window:
        raise ValueError(f"the {backend.name} attention backend has no sliding window, which {spec.architecture}'s "
                         "sliding_attention layers need; use attention_backend='torch' or 'triton'")
    return RankModel(model, rank_spec, num_blocks, backend, pools.num_sliding_blocks)


def compile_decision(model: CausalLM, config: EngineConfig, device: torch.device) -> tuple[bool, str]:
    """Whether this rank compiles the model's forward (models/compiled_forward.py), and why, in words that
    the engine logs at start-up and `minivllm bench` prints."""
    if config.enforce_eager:
        return False, "eager (enforce_eager=True)"
    if config.batch_invariant:  # EngineConfig refuses enforce_eager=False with it
        return False, "eager (batch_invariant=True: one kernel per row whatever the step's size)"
    if not model.supports_compile:
        return False, f"eager: {type(model).__name__} is not compiled ({model.eager_reason})"
    if config.tensor_parallel_size > 1:
        return False, (f"eager: tensor_parallel_size={config.tensor_parallel_size} (its all-reduces inside a "
                       "compiled graph are not supported yet)")
    if config.enforce_eager is None and device.type == "cpu":
        # Measured (docs/guides/benchmarks.md): on 2 CPU cores a cold compile of the default model takes
        # ~20 s a size, a start with Inductor's cache warm still 2-20x an eager one, for +5-30 % a step
        # (AMD EPYC; even with eager on a Xeon guest);
        # tests, notebooks and a first `generate` should start in seconds. On a GPU fusing the forward
        # removes most kernel launches.
        return False, "eager (enforce_eager=None on CPU: compiling costs start-up time; pass False to compile)"
    return True, f"compiled for steps of up to {max(config.compile_sizes)} tokens {config.compile_sizes}"
