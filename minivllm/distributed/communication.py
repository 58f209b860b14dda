"""`CommandChannel`: how rank 0 tells the tensor-parallel workers what to do, over torch.distributed.

A command is any picklable object (the engine's are in engine/executor/commands.py); every worker
receives the same ones, in the same order.

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
from typing import Any

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import ParallelContext


class CommandChannel:
    """Rank 0 sends, every worker receives the same command, in the same order."""

    def __init__(self, tp: ParallelContext) -> None:
        self.tp = tp

    @staticmethod
    def encode(command: object) -> bytes:
        try:
            return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a lambda as collective_rpc method
            raise TypeError(f"{type(command).__name__} cannot be sent to the workers: {e} (they receive "
                            "functions by name: pass a module-level function)") from e

    def send(self, data: bytes) -> None:  # rank 0: an encoded command
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.tp.wake_group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.tp.cpu_group)

    def receive(self) -> object:  # workers
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
