"""What rank 0 tells the tensor-parallel workers: one typed command at a time, over the command
channel (distributed/communication.py), in the same order on every worker.

    WorkerStart    the first command: the engine's config (the workers build their shard from it)
    StepInputs     run this step's forward: the packed batch of `ModelRunner.prepare_inputs`
                   (engine/worker/step_inputs.py)
    CollectiveRpc  run a function on every rank (`LLMEngine.collective_rpc`); results come back
    Shutdown       leave the loop and the group; the process exits

The scheduler and the block manager live on rank 0 only. A worker needs nothing of them but the
step's tensors: it never sees a request, a token's text or a sampling parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from minivllm.config import EngineConfig
from minivllm.engine.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from minivllm.engine.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerStart:
    config: EngineConfig  # dtype resolved by rank 0; the scheduler's and the proposer's options cleared


@dataclass(frozen=True)
class CollectiveRpc:
    method: Callable[[int, "ModelRunner"], Any]  # called as method(rank, model_runner); picklable by name


@dataclass(frozen=True)
class Shutdown:
    pass


WorkerCommand = Union[WorkerStart, StepInputs, CollectiveRpc, Shutdown]
