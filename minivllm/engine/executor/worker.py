"""A tensor-parallel worker: one process, one rank, its shard of the weights and of the KV pool.

    worker_main                     spawned by rank 0 (engine/executor/multiproc.py), or on another node
                                    by `python -m minivllm.distributed` (`main` below)
      init_parallel_context         join the group: blocks until every rank has joined
      WorkerStart                   the engine's config, from rank 0
      build_model_runner            read only this rank's slices of the checkpoint; agree on the pool size
                                    (engine/worker/runner_builder.py, as rank 0 does)
      warm-up, then meet rank 0     time the CPU kernels, as rank 0 does; rank 0 waits for that before
                                    anything else (parallel_state.py: the start-up group)
      loop over commands            StepInputs    -> `ModelRunner.forward`, the one forward path: the same
                                                     all-reduces as every other rank, then its slice of
                                                     the logits, gathered on rank 0 (which alone samples)
                                    CollectiveRpc -> run the function, send the result back
                                    Shutdown      -> leave the group, exit

A worker never catches an exception to carry on: a rank that failed mid-step is out of step with the
others for good. Anything raised ends the process; torch.multiprocessing keeps the traceback for
rank 0's error message, and the exit closes the worker's connections, so a rank waiting for it in a
collective fails at once instead of at the timeout. Ctrl-C is ignored here: the terminal sends SIGINT
to every process of the job, and stopping is the engine's call (it then shuts the workers down).
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.distributed.communication import CommandChannel
from minivllm.distributed.parallel_state import (ParallelContext, Rendezvous, close_parallel_context,
                                                init_parallel_context)
from minivllm.engine.executor.commands import CollectiveRpc, Shutdown, WorkerStart
from minivllm.engine.worker.loading import resolve_dtype
from minivllm.engine.worker.runner_builder import build_model_runner
from minivllm.engine.worker.step_inputs import StepInputs
from minivllm.models.hf_config import load_model_spec


@dataclass(frozen=True)
class WorkerLaunch:
    """How the workers of one node find rank 0 (what `start_processes` hands each of them)."""

    first_rank: int  # global rank of this node's first worker
    first_local_rank: int  # its index on this node (picks the GPU: cuda:local_rank)
    world_size: int
    rendezvous: Rendezvous
    timeout_s: float
    device_type: str  # "cpu" or "cuda": the collectives' backend must be the same on every rank
    num_threads: int  # torch's CPU threads per worker: rank 0's own setting


class Worker:
    """One rank's shard of the model and of the KV pool, with a `ModelRunner` holding the pool."""

    def __init__(self, tp: ParallelContext, config: EngineConfig) -> None:
        spec = load_model_spec(config.model)
        dtype = resolve_dtype(config, spec, tp.device)
        self.tp = tp
        # as rank 0's warm-up does: time the CPU kernels on this rank's shapes (before meeting rank 0)
        self.runner = build_model_runner(config, spec, tp.device, dtype, tp, measure_kernels=config.warmup)

    @torch.inference_mode()
    def serve(self, channel: CommandChannel) -> None:
        while True:
            match channel.receive():
                case StepInputs() as step:  # rank 0's forward, on this rank's shard; no sampling here
                    self.runner.forward(step)
                case CollectiveRpc(method):
                    channel.gather(method(self.tp.rank, self.runner))
                case Shutdown():
                    return
                case command:
                    raise TypeError(f"worker rank {self.tp.rank}: unexpected command {type(command).__name__}")


def worker_main(local_index: int, launch: WorkerLaunch, started: Any = None) -> None:
    """A worker process's whole life (the target of torch.multiprocessing's spawn). `started`: a queue on
    which it says it has imported everything and is about to join (rank 0 watches the processes until
    then, so a worker that dies while starting is reported at once, not after the join's timeout)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if started is not None:
        started.put(local_index)
    torch.set_num_threads(launch.num_threads)
    rank, local_rank = launch.first_rank + local_index, launch.first_local_rank + local_index
    device = torch.device("cuda", local_rank) if launch.device_type == "cuda" else torch.device("cpu")
    tp = init_parallel_context(rank, launch.world_size, launch.rendezvous, launch.timeout_s, device)
    channel = CommandChannel(tp)
    start = channel.receive()
    if not isinstance(start, WorkerStart):
        raise TypeError(f"worker rank {rank}: expected WorkerStart first, got {type(start).__name__}")
    worker = Worker(tp, start.config)
    tp.wait_for_every_rank()  # rank 0 waits here too: for the workers' warm-up, with the start-up bound
    worker.serve(channel)
    close_parallel_context()  # a clean exit; after an exception the process simply ends


def main(argv: list[str] | None = None) -> None:
    """`python -m minivllm.distributed`: this node's ranks of an engine whose rank 0 runs on another
    node. Reads the usual variables: MASTER_ADDR and MASTER_PORT (rank 0's), WORLD_SIZE
    (= tensor_parallel_size), RANK (this node's first rank), LOCAL_WORLD_SIZE (ranks here, default 1)."""
    parser = argparse.ArgumentParser(prog="python -m minivllm.distributed", description=main.__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--distributed-timeout-s", type=float,
                        default=EngineConfig.__dataclass_fields__["distributed_timeout_s"].default)
    args = parser.parse_args(argv)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if v not in os.environ]
    if missing:
        parser.error(f"set {', '.join(missing)} (rank 0's address and port, the group's size, this node's first rank)")
    env = os.environ
    launch = WorkerLaunch(int(env["RANK"]), 0, int(env["WORLD_SIZE"]), Rendezvous.across_nodes(),
                          args.distributed_timeout_s, args.device, torch.get_num_threads())
    torch.multiprocessing.start_processes(worker_main, args=(launch,), nprocs=int(env.get("LOCAL_WORLD_SIZE", 1)),
                                          join=True, start_method="spawn")
