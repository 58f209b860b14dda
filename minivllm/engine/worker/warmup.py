"""Warm-up: the CPU kernels chosen by timing them on this machine, and the first steps run before any request.

    measure_cpu_kernels   choose the matmul forms (cpu/matmul_plan.py), RMSNorm's and RoPE's two ways
                          (cpu/norm_rope_kernels.py), decode attention's and greedy sampling's
                          (cpu/decode_kernels.py) through the one tuner (cpu/tuner.py): read from the
                          tuning cache, or timed, the faster kept and saved; set them on the model's
                          plain layers (cpu/attach.py), the attention backend and the sampler, which
                          hold the switches and choose nothing; say what was chosen and whether it was
                          cached or measured
    warmup_plans          the steps warm-up runs (`Executor.warmup`), each a `warmup_batch` of prompts
                          on free, uncached blocks: one small prefill through the whole stack, so that
                          lazy initialisation (allocators, kernels' first calls, a compiled model's
                          graphs, one per size) happens before the first request is timed

Every rank measures its own kernels on its own shapes (a tensor-parallel worker too). A GPU, or a
model, backend or sampler without the choice, keeps its defaults. In batch-invariant mode nothing is
timed: every path is fixed in advance (layers/batch_invariance.py; its tiled matmul was attached when the
model was loaded, engine/worker/loading.py), so no choice can differ.
"""

from __future__ import annotations

import torch

from minivllm.cpu.attach import NormRopeSizes, attach_cpu_kernels
from minivllm.cpu.decode_kernels import choose_decode_kernel, choose_greedy_kernel
from minivllm.cpu.tuner import Tuning
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ScheduledSequence, SchedulerOutput, StateRow
from minivllm.layers.attention import AttentionBackend
from minivllm.layers.batch_invariance import TiledLinearMethod
from minivllm.layers.sampler import Sampler, TritonSampler
from minivllm.layers.torch_attention import TorchAttentionBackend
from minivllm.models.hf_config import ModelSpec
from minivllm.models.interface import CausalLM
from minivllm.sampling_params import SamplingParams


def measure_cpu_kernels(model: CausalLM, spec: ModelSpec, backend: AttentionBackend, sampler: Sampler | TritonSampler,
                        kv_dtype: torch.dtype, block_size: int, device: torch.device,
                        tuning: Tuning = "cached") -> list[str]:
    """Choose each kernel on this machine for `model` (`spec`: this rank's view) and attach what was chosen;
    one line each of what was chosen (logged at INFO, and printed by `minivllm bench`). Idempotent for the
    matmuls."""
    head = model.lm_head_layer
    if isinstance(head.quant_method, TiledLinearMethod):  # the kernels stay on their defaults: torch's ops
        return [head.quant_method.summary(), str(backend), "RMSNorm, RoPE and silu·mul: torch ops; greedy "
                "sampling: argmax in float32 (batch_invariant=True: nothing measured)"]
    if device.type != "cpu":
        return ["matmul: F.linear everywhere (not measured: no CPU warm-up)"]
    sizes = (NormRopeSizes(spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                           spec.intermediate_size) if model.cpu_norm_rope_kernels else None)
    said = attach_cpu_kernels(model, head, tuning, sizes)
    if isinstance(backend, TorchAttentionBackend):  # the Triton backend has no CPU kernel to choose
        said.append(str(choose_decode_kernel(backend, kv_dtype, block_size, tuning)))
    if isinstance(sampler, Sampler):
        said.append(str(choose_greedy_kernel(sampler, spec.vocab_size, kv_dtype, tuning)))
    return said


def warmup_plans(compile_sizes: tuple[int, ...], block_size: int, num_blocks: int, num_sliding_blocks: int,
                 max_positions: int, hybrid: bool, num_tokens: int = 8) -> list[SchedulerOutput]:
    """One plan of `num_tokens` prompt tokens, or a compiled model's one of each of its `compile_sizes`, on
    the blocks both pools have (`num_sliding_blocks`: the sliding-window layers' pool; 0: none)."""
    pool = min(num_blocks, num_sliding_blocks) if num_sliding_blocks else num_blocks
    return [SchedulerOutput(warmup_batch(min(n, pool * block_size), block_size, pool, max_positions,
                                         hybrid=hybrid, sliding=bool(num_sliding_blocks)))
            for n in compile_sizes or (num_tokens,)]


def warmup_batch(n: int, block_size: int, num_blocks: int, max_positions: int,
                 hybrid: bool = False, sliding: bool = False) -> list[ScheduledSequence]:
    """Prompts of n tokens in all, none longer than the model's positions (a compiled size may be larger
    than one sequence can be: its RoPE table would be read out of bounds), on distinct free blocks."""
    batch, first_block = [], 0
    while n > 0 and first_block < num_blocks:
        length = min(n, max_positions, (num_blocks - first_block) * block_size)
        seq = Sequence(f"warmup-{len(batch)}", [0] * length, SamplingParams(temperature=1.0, top_p=0.9))
        seq.block_table = list(range(first_block, first_block + -(-length // block_size)))
        if sliding:  # the same block ids in the sliding-window group's pool (`num_blocks` fits both)
            seq.sliding_block_table = list(seq.block_table)
        # a hybrid's row reads nothing (start 0) and writes pair 0's staging slot, never published
        state = StateRow(read_slot=0, write_slot=1) if hybrid else None
        batch.append(ScheduledSequence(seq, 0, length, state=state))
        first_block, n = first_block + len(seq.block_table), n - length
        if hybrid:
            break  # one staging slot: one sequence (hybrid models are not compiled anyway)
    return batch
