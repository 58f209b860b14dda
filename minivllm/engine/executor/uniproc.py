"""`UniProcExecutor` (vLLM's name): one rank, in this process — the model runner called directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from minivllm.engine.executor.abstract import Executor
from minivllm.engine.request.step_types import ModelRunnerOutput, SchedulerOutput
from minivllm.engine.resolved_config import ResolvedConfig
from minivllm.engine.worker.model_runner import ModelRunner
from minivllm.engine.worker.runner_builder import build_model_runner
from minivllm.engine.worker.state_tensors import StateTensors

T = TypeVar("T")


class UniProcExecutor(Executor):
    def __init__(self, config: ResolvedConfig, state_tensors: StateTensors | None = None) -> None:
        self.runner = build_model_runner(config.engine, config.spec, config.device, config.dtype,
                                         eos_token_ids=config.eos_token_ids, state_tensors=state_tensors)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def collective_rpc(self, method: Callable[[int, ModelRunner], T]) -> list[T]:
        return [method(0, self.runner)]
