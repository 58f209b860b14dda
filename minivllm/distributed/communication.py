"""What rank 0 tells the workers, and how: one typed command at a time, over torch.distributed.

    WorkerStart    the first command: the engine's config (the workers build their shard from it)
    StepInputs     run this step's forward: the packed batch of `ModelRunner.prepare_inputs`
    CopyBlocks     copy-on-write of KV blocks (`n > 1` forks): every rank copies its own heads
    CollectiveRpc  run a function on every rank (`LLMEngine.collective_rpc`); results come back
    Shutdown       leave the loop and the group; the process exits

The scheduler and the block manager live on rank 0 only. A worker needs nothing of them but the
step's tensors: it never sees a request, a token's text or a sampling parameter.

Sending a command (rank 0)                    receiving it (every worker)
  pickle it: n bytes
  broadcast n      over the wake group  --->  waits here between steps, however long the engine idles
  broadcast bytes  over the cpu group   --->  bounded: a rank that stops answering fails the step
(parallel_state.py says why the two waits need two groups.) The step's inputs are a few integer
tensors of the batch's size; pickling them is simpler than one broadcast per field and costs tens
of microseconds.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from minivllm.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerStart:
    config: EngineConfig  # dtype resolved by rank 0; the scheduler's and the proposer's options cleared


@dataclass(frozen=True)
class StepInputs:
    """Everything a rank needs to run its shard of one step's forward. CPU tensors (a pickled CUDA
    tensor would come back on rank 0's GPU); each rank moves them to its own device."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    context_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_lens: list[int]
    context_lens_host: list[int]
    block_size: int
    logits_indices: torch.Tensor  # (S,) int64: the rows whose logits rank 0 samples

    @classmethod
    def pack(cls, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             logits_indices: torch.Tensor) -> "StepInputs":
        return cls(input_ids.cpu(), positions.cpu(), meta.slot_mapping.cpu(), meta.cu_seqlens_q.cpu(),
                   meta.context_lens.cpu(), meta.block_tables.cpu(), meta.query_lens, meta.context_lens_host,
                   meta.block_size, logits_indices.cpu())

    def __reduce__(self) -> tuple:
        """Pickled as numpy arrays: torch's own pickling of these small tensors was measured at 0.5 ms
        a step to encode and as much to decode (2 CPU cores), numpy's at 0.03 ms."""
        values = [getattr(self, f.name) for f in fields(self)]
        return _step_inputs, (tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in values),)

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device), cu_seqlens_q=self.cu_seqlens_q.to(device),
            context_lens=self.context_lens.to(device), block_tables=self.block_tables.to(device),
            query_lens=self.query_lens, context_lens_host=self.context_lens_host, block_size=self.block_size)


def _step_inputs(values: tuple) -> StepInputs:
    return StepInputs(*(torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in values))


@dataclass(frozen=True)
class CopyBlocks:
    pairs: list[tuple[int, int]]  # (source block, destination block)


@dataclass(frozen=True)
class CollectiveRpc:
    method: Callable[[int, "ModelRunner"], Any]  # called as method(rank, model_runner); picklable by name


@dataclass(frozen=True)
class Shutdown:
    pass


WorkerCommand = Union[WorkerStart, StepInputs, CopyBlocks, CollectiveRpc, Shutdown]


class CommandChannel:
    """Rank 0 sends, every worker receives the same command, in the same order."""

    def __init__(self, tp: ParallelContext) -> None:
        self.tp = tp

    @staticmethod
    def encode(command: WorkerCommand) -> bytes:
        try:
            return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a lambda as collective_rpc method
            raise TypeError(f"{type(command).__name__} cannot be sent to the workers: {e} (they receive "
                            "functions by name: pass a module-level function)") from e

    def send(self, data: bytes) -> None:  # rank 0: an encoded command
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.tp.wake_group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.tp.cpu_group)

    def receive(self) -> WorkerCommand:  # workers
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.tp.wake_group)  # the one wait that may last
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.tp.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def gather(self, value: Any) -> list[Any] | None:
        """Rank 0 gets every rank's `value` (picklable), in rank order; the workers get None."""
        out = [None] * self.tp.world_size if self.tp.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.tp.cpu_group)
        return out
