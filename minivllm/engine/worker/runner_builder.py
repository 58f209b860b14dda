"""`build_model_runner`: the one way a `ModelRunner` is made, for every rank and for the draft model.

    load_rank         this rank's model (its shard under tensor parallelism), the KV pool's size agreed
                      with the other ranks, the attention backend (engine/worker/loading.py)
    ModelRunner       allocates the KV pool (and a sliding-window model's second pool) on this rank
    samplers          chosen by the backend's type (`samplers_for`), never by its name
    CUDA graphs       on where they can run: CUDA, the compiled forward, a backend that runs inside
                      them, one rank, no hybrid state (`enable_cuda_graphs`, engine/worker/cuda_graphs.py)
    kernel timing     with `measure_kernels`: the CPU kernels chosen now (engine/worker/warmup.py)

Who calls it: `UniProcExecutor` (one rank), `MultiprocExecutor` for rank 0 and every tensor-parallel
worker (engine/executor/), and the draft model (engine/spec_decode/draft_model.py), whose config names
its own checkpoint, the target's pool plus scratch blocks, and no compiling. Only a worker times its
kernels here, before it meets rank 0; rank 0 times its own in `Executor.warmup`, once every rank is
built, then runs the first steps. The draft model's kernels are never timed: they keep their defaults.
"""

from __future__ import annotations

import torch

from minivllm.config import EngineConfig
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.engine.spec_decode.rejection_sampler import RejectionSampler, TritonRejectionSampler, Verifier
from minivllm.engine.worker.cuda_graphs import Capture, CUDAGraphRunner, cuda_graph_capture
from minivllm.engine.worker.loading import load_rank
from minivllm.engine.worker.model_runner import ModelRunner
from minivllm.engine.worker.state_tensors import StateTensors
from minivllm.layers.attention import AttentionBackend
from minivllm.layers.sampler import Sampler, TritonSampler
from minivllm.layers.triton_attention import TritonAttentionBackend
from minivllm.models.hf_config import ModelSpec


def build_model_runner(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                       tp: ParallelContext | None = None, *, eos_token_ids: frozenset[int] = frozenset(),
                       state_tensors: StateTensors | None = None, measure_kernels: bool = False) -> ModelRunner:
    """This rank's runner (`tp`: its place in the group; None: one rank). On several ranks this meets the
    others inside `load_rank` (the pool's size is agreed by a collective): every rank calls it at once."""
    tp = tp if tp is not None else ParallelContext()
    rank = load_rank(config, spec, device, dtype, tp)
    sampler, rejection_sampler = samplers_for(rank.backend)
    runner = ModelRunner(rank, block_size=config.block_size, dtype=dtype, device=device, sampler=sampler,
                         rejection_sampler=rejection_sampler, eos_token_ids=eos_token_ids,
                         state_tensors=state_tensors, one_rank=tp.world_size == 1)
    if device.type == "cuda" and cuda_graphs_refusal(runner) is None:
        enable_cuda_graphs(runner, cuda_graph_capture(torch.cuda.graph_pool_handle()))
    if measure_kernels:
        runner.measure_cpu_kernels(config.tuning)
    return runner


def samplers_for(backend: AttentionBackend) -> tuple[Sampler | TritonSampler, Verifier]:
    """The sampler and the drafts' verifier: Triton's beside the Triton backend (kernels of the same family, on
    the GPU it runs on); PyTorch's beside any other, yours included. A backend's type decides, not its `name`."""
    if isinstance(backend, TritonAttentionBackend):
        return TritonSampler(), TritonRejectionSampler()
    return Sampler(), RejectionSampler()


def cuda_graphs_refusal(runner: ModelRunner) -> str | None:
    """Why `runner`'s decode steps cannot replay CUDA graphs; None if they can."""
    if runner.scratch_block is None or not runner.backend.supports_cuda_graphs or not runner.one_rank \
            or runner.state_tensors is not None:
        return ("CUDA graphs need the compiled forward (enforce_eager=False), the Triton attention backend, one "
                "rank and a model without linear-attention layers")
    return None


def enable_cuda_graphs(runner: ModelRunner, capture: Capture) -> None:
    """`runner`'s decode steps of the compiled sizes run as recorded graphs from now on (`capture` records
    one; tests on CPU pass `cuda_graphs.replay_by_rerun`). Needs the scratch block of a compiled model."""
    refusal = cuda_graphs_refusal(runner)
    if refusal is not None:
        raise ValueError(refusal)
    max_blocks = min(runner.num_blocks, -(-runner.spec.max_position_embeddings // runner.block_size))
    runner.cuda_graphs = CUDAGraphRunner(runner.compile_sizes, max_blocks_per_seq=max_blocks,
                                         scratch_block=runner.scratch_block, block_size=runner.block_size,
                                         backend=runner.backend, device=runner.device, capture=capture)
