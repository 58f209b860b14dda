"""`Executor` (vLLM's name): the engine's one handle on the ranks that run the model.

    execute_model(scheduler_output) -> ModelRunnerOutput   one step: pack, forward on every rank, sample
    collective_rpc(method)                                 method(rank, model_runner) on every rank
    warmup()                                               time the CPU kernels, run the first steps
    shutdown()                                             end the workers, if any

`runner` is rank 0's `ModelRunner`: it packs and samples (the other ranks only run the forward).
Every executor builds its ranks' runners in its constructor, from the resolved config, each with
`build_model_runner` (engine/worker/runner_builder.py).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import TypeVar

from minivllm.cpu.tuner import Tuning
from minivllm.engine.request.step_types import ModelRunnerOutput, SchedulerOutput
from minivllm.engine.worker.model_runner import ModelRunner
from minivllm.engine.worker.warmup import warmup_plans

T = TypeVar("T")


class Executor(abc.ABC):
    runner: ModelRunner  # rank 0's

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's results."""

    @abc.abstractmethod
    def collective_rpc(self, method: Callable[[int, ModelRunner], T]) -> list[T]:
        """`method(rank, model_runner)` on every rank, the results in rank order."""

    def warmup(self, tuning: Tuning = "cached") -> None:
        """Choose the CPU kernels (cached, or by timing them; logged at INFO, printed by `minivllm bench`),
        then run the warm-up steps through the whole stack (engine/worker/warmup.py)."""
        r = self.runner
        for line in r.measure_cpu_kernels(tuning):
            logging.getLogger("minivllm").info("%s", line)
        for plan in warmup_plans(r.compile_sizes, r.block_size, r.num_blocks, r.num_sliding_blocks,
                                 r.spec.max_position_embeddings, hybrid=r.state_tensors is not None):
            self.execute_model(plan)

    def shutdown(self) -> None:
        """End what the executor started. Safe to call twice."""
