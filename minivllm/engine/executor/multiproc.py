"""`MultiprocExecutor` (vLLM's name): rank 0's side of tensor parallelism. It starts the workers,
sends them every step, turns any failure into `EngineDeadError`, and ends them.

    start-up   spawn ranks 1 .. L-1 (torch.multiprocessing, "spawn"; L = LOCAL_WORLD_SIZE, by default
               tensor_parallel_size; the ranks of other nodes run `python -m minivllm.distributed`),
               join the group as rank 0, then every rank builds its shard (WorkerStart) and the workers
               warm up; rank 0 waits for that, with the start-up bound (distributed/parallel_state.py)
    a step     `runner.execute_model(plan, on_every_rank=self.run)`: rank 0 packs the step, then inside
               `run(StepInputs)` the workers run the same forward on their shards (engine/executor/
               worker.py); the all-reduces keep the ranks in lockstep and the logits are gathered on
               rank 0, which samples alone
    shutdown   Shutdown to every worker, wait a few seconds, kill what is left, leave the group

The failure model. Inside `run` the ranks are in lockstep, so an exception on any rank there leaves
the others waiting inside a collective that will never complete; a status flag exchanged after the
forward could not reach them. What ends the wait instead:
  * a worker that raises exits (torch.multiprocessing keeps its traceback); its exit closes its
    sockets and rank 0's pending collective fails at once ("Connection closed by peer");
  * a worker that is killed: the same, without a traceback (the signal is reported);
  * a worker that hangs: rank 0's collective times out after `distributed_timeout_s`;
  * rank 0 raising inside `run`: the workers are left mid-step.
Each way, rank 0 kills the remaining workers and raises `EngineDeadError` with the worker's own error
when it has one: the engine treats it as fatal, never retried or bisected (engine/request/errors.py).
Outside `run` (packing the batch before, sampling after) the ranks are in step, and an exception
there is an ordinary one: the engine's isolation by bisection works as with one rank. For the same
reason a Ctrl-C inside `run` is held until the step's collectives are done (at most the timeout),
then raised: the ranks stay in step and the engine survives it, as it does with one rank. A second
Ctrl-C is not held: it interrupts at the next Python line (a collective under way still completes
or times out first) and ends the engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from minivllm.distributed.communication import CommandChannel
from minivllm.distributed.parallel_state import (JOIN_TIMEOUT_S, Rendezvous, close_parallel_context,
                                                init_parallel_context)
from minivllm.engine.executor.abstract import Executor
from minivllm.engine.executor.commands import CollectiveRpc, Shutdown, WorkerCommand, WorkerStart
from minivllm.engine.executor.worker import WorkerLaunch, worker_main
from minivllm.engine.request.errors import EngineDeadError
from minivllm.engine.request.step_types import ModelRunnerOutput, SchedulerOutput
from minivllm.engine.resolved_config import ResolvedConfig
from minivllm.engine.worker.model_runner import ModelRunner
from minivllm.engine.worker.runner_builder import build_model_runner

T = TypeVar("T")
SHUTDOWN_GRACE_S = 5.0  # how long a worker has to leave after Shutdown before it is killed


class MultiprocExecutor(Executor):
    def __init__(self, resolved: ResolvedConfig) -> None:
        """Start the local workers, join the group as rank 0, and build every rank's shard."""
        config, device = resolved.engine, resolved.device
        world = config.tensor_parallel_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this node, rank 0 included
        if not 1 <= local <= world:
            raise ValueError(f"LOCAL_WORLD_SIZE={local} must be between 1 and tensor_parallel_size={world}")
        if device.type == "cuda" and local > torch.cuda.device_count():
            raise ValueError(f"{local} ranks on this node need {local} GPUs (rank r uses cuda:r); "
                             f"{torch.cuda.device_count()} are visible: lower tensor_parallel_size")
        self.rendezvous = Rendezvous.across_nodes() if local < world else Rendezvous.on_this_node()
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
        self.timeout_s = config.distributed_timeout_s
        launch = WorkerLaunch(first_rank=1, first_local_rank=1, world_size=world, rendezvous=self.rendezvous,
                              timeout_s=self.timeout_s, device_type=device.type, num_threads=torch.get_num_threads())
        started = mp.get_context("spawn").SimpleQueue()
        self.workers = (mp.start_processes(worker_main, args=(launch, started), nprocs=local - 1, join=False,
                                           daemon=True, start_method="spawn") if local > 1 else None)
        # Dropped without shutdown() (or the interpreter exits): end the workers all the same.
        self._finalizer = weakref.finalize(self, _abandon, self.worker_processes, self.rendezvous)
        self._dead: str | None = None  # why the group can no longer be used
        try:
            self._wait_for_workers_to_start(started, local - 1)
            self.tp = init_parallel_context(0, world, self.rendezvous, self.timeout_s, device)
        except Exception as error:
            message = self._fail(error)
            raise RuntimeError(f"starting {world} tensor-parallel ranks failed: {message}") from error
        self.channel = CommandChannel(self.tp)
        try:
            self.runner = self._load_ranks(resolved)
        except BaseException:  # e.g. a worker that fails to load: none may outlive us
            self.shutdown()
            raise

    def _wait_for_workers_to_start(self, started: Any, count: int) -> None:
        """Until every local worker says it is about to join, watch their processes: one that dies while
        importing or starting (a missing library, the OOM killer) is reported now, with its error, rather
        than after the join's timeout."""
        deadline, seen = time.monotonic() + max(self.timeout_s, JOIN_TIMEOUT_S), 0
        while seen < count:
            while not started.empty() and seen < count:
                started.get()
                seen += 1
            if seen == count:
                return
            if any(p.exitcode is not None for p in self.worker_processes):
                raise RuntimeError("a worker exited while starting")  # _fail adds the worker's own report
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not start within {max(self.timeout_s, JOIN_TIMEOUT_S):g} s")
            time.sleep(0.05)

    @property
    def worker_processes(self) -> list[mp.Process]:
        return list(self.workers.processes) if self.workers is not None else []

    def _load_ranks(self, resolved: ResolvedConfig) -> ModelRunner:
        """Rank 0's shard and runner, built while every worker builds its own (they end in the same collective)."""
        config, dtype = resolved.engine, resolved.dtype
        # The scheduler's, the proposer's and the sampler's parts are rank 0's business, and may not pickle.
        worker_config = config.replace(dtype=str(dtype).removeprefix("torch."), speculative_config=None,
                                       scheduling_policy="fcfs", sampling_filter=None, block_allocator=None)
        with self.run(WorkerStart(worker_config)):
            runner = build_model_runner(config, resolved.spec, self.tp.device, dtype, self.tp,
                                        eos_token_ids=resolved.eos_token_ids)
            # Wait (with the start-up bound, not a step's) until every worker has built its shard and warmed up,
            # however long that takes on a busy machine; then each waits for commands, which is no failure.
            self.tp.wait_for_every_rank()
        return runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, on_every_rank=self.run)

    @contextmanager
    def run(self, command: WorkerCommand) -> Iterator[None]:
        """Send `command` to every worker; the body is rank 0's share of it. Any failure in here
        leaves the ranks out of step: the workers are ended and `EngineDeadError` raised."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        message = self.channel.encode(command)  # a command that does not pickle fails here, harmlessly
        with _ctrl_c_held():
            try:
                self.channel.send(message)
                yield
            except Exception as error:
                raise EngineDeadError(self._fail(error)) from error
            except BaseException as error:  # a second Ctrl-C: the workers are left mid-step
                self._fail(error)
                raise

    def collective_rpc(self, method: Callable[[int, ModelRunner], T]) -> list[T]:
        """`method(rank, model_runner)` on every rank; the results in rank order."""
        with self.run(CollectiveRpc(method)):
            return self.channel.gather(method(0, self.runner))

    def shutdown(self) -> None:
        """Tell the workers to stop, give them `SHUTDOWN_GRACE_S`, kill what is left, leave the group.
        Safe to call twice, and after a failure."""
        if self._dead is None:
            self._dead = "the engine was shut down"
            try:
                self.channel.send(self.channel.encode(Shutdown()))
            except Exception:
                pass  # a worker is gone already: the others are killed below
        _end_processes(self.worker_processes, SHUTDOWN_GRACE_S)
        close_parallel_context()
        self.rendezvous.remove()
        self._finalizer.detach()

    # --- failures ---------------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> str:
        """Say what happened (with the worker's own error when there is one), end the workers and
        leave the group; the executor refuses every later command with the same message."""
        seen = f"{type(error).__name__}: {error}".rstrip()
        report = self._worker_report()
        message = (f"tensor parallelism failed: {report}\n(what rank 0 saw: {seen})" if report else
                   f"tensor parallelism failed: {seen}")
        message += (f"\n(a worker that dies, raises, or does not answer within distributed_timeout_s="
                    f"{self.timeout_s:g} s ends the engine: create it again)")
        self._dead = message
        _end_processes(self.worker_processes, grace_s=0.0)
        close_parallel_context()
        self.rendezvous.remove()
        self._finalizer.detach()  # nothing left to end (and the next engine's group is not ours to close)
        return message

    def _worker_report(self, wait_s: float = 1.0) -> str:
        """What a failed worker left behind: its traceback, or the signal or exit code that ended it."""
        if self.workers is None:
            return ""
        try:
            self.workers.join(timeout=wait_s)  # raises for the first worker that exited abnormally
        except mp.ProcessRaisedException as e:
            trace = str(e).split("terminated with the following error:\n", 1)[-1].strip()
            return f"worker rank {e.error_index + 1} (pid {e.error_pid}) raised:\n{trace}"
        except mp.ProcessExitedException as e:
            how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
            return f"worker rank {e.error_index + 1} (pid {e.error_pid}) was ended by {how}"
        return ""


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold a first Ctrl-C until the block is done, then raise KeyboardInterrupt; a second one is
    not held. Signal handlers belong to the main thread: elsewhere (a server's engine thread, which
    receives no SIGINT anyway) this does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    pressed = []

    def hold(signum: int, frame: object) -> None:
        pressed.append(signum)
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _end_processes(processes: list[mp.Process], grace_s: float) -> None:
    """Wait up to `grace_s` for the processes to exit, then kill the rest (SIGKILL also ends a stopped one)."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


def _abandon(processes: list[mp.Process], rendezvous: Rendezvous) -> None:
    _end_processes(processes, grace_s=0.0)
    close_parallel_context()
    rendezvous.remove()
