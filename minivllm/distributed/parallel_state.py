"""`ParallelContext`: which rank this process is, and the process groups its collectives go through.

One process per rank; rank 0 is the engine, ranks 1..N-1 are workers (engine/executor/worker.py). Each
builds its context once (`init_parallel_context`) and hands it down to the model: every layer that
communicates takes it as an argument, so there is no module-level "current group" to look up.

Four groups, each for one kind of wait:

    device_group   the forward's collectives: the all-reduce after the embedding, o_proj and down_proj,
                   and the gather of the logits. NCCL on CUDA, gloo on CPU. Bounded by
                   `distributed_timeout_s`: a rank that does not answer in time fails the step.
    cpu_group      gloo, bounded the same way: the pickled command of each step and the results of
                   `collective_rpc`. On CPU this is the device group itself.
    wake_group     gloo: the 8 bytes "a command of n bytes follows" that workers wait on between
                   steps. An idle engine (a server with no requests for an hour) is not a failure, so
                   on the workers this group's waits are effectively unbounded; on rank 0 they are
                   bounded like the others (gloo's sender waits for the receiver to be ready, so a
                   stopped worker would otherwise block rank 0's send forever). A group's timeout is
                   each process's own: the same group can be patient on one side and not the other.
    startup_group  gloo: the meetings of start-up, where one rank may be far behind another for reasons
                   that are no hang: agreeing on the KV pool's size after loading the weights, and a
                   last meeting, which a worker joins once it has built its shard and timed its CPU
                   kernels (compiling them the first time: a minute on 2 idle cores, several on a busy
                   one), and rank 0 right after loading its own shard, before its own warm-up. Bounded by `STARTUP_TIMEOUT_S` (or the step timeout if longer). A rank
                   that dies meanwhile closes its connections: the others fail at once, not at the bound.

Joining is bounded separately, by `JOIN_TIMEOUT_S` (or the step timeout if longer): rank 0 waits
there for the workers to start, and a fresh process takes seconds to import torch. (gloo bounds a
wait by its group's timeout only, never by a call's own: hence one group per kind of wait.)

A single process (tensor_parallel_size=1) uses `ParallelContext()`: rank 0 of 1, no groups, and
every collective below returns its input unchanged, so the model code has one path.

torch.distributed itself keeps the default group process-wide (`init_process_group` can be called
once per process until `destroy_process_group`). That state is torch's, not ours, and it means one
tensor-parallel engine per process at a time: a second one is refused with a message.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=365)  # how long a worker may wait for the next command
JOIN_TIMEOUT_S = 120.0  # how long rank 0 waits for every rank to join (at least)
STARTUP_TIMEOUT_S = 1800.0  # how far one rank's start-up may fall behind another's (at least)


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    wake_group: dist.ProcessGroup | None = None
    startup_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the sum)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dimension, in rank order (the
        vocabulary slices of the logits: (S, V/N) each -> (S, V)); the other ranks get None."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. how many KV blocks fit: the pool must be as
        big on every rank, and no rank may promise more than it has). A start-up meeting."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.startup_group)
        return int(t.item())

    def wait_for_every_rank(self) -> None:
        """The last meeting of start-up: rank 0 right after loading its shard, each worker once it has also
        warmed up. From then on a worker waits for commands on the wake group only."""
        if self.world_size > 1:
            dist.barrier(group=self.startup_group)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet to form the group. On one node, a file in a private folder: nothing listens on
    the network (torch's TCP store listens on every interface, for the engine's whole life). Across nodes,
    rank 0's TCP address, which the user gives every node (MASTER_ADDR, MASTER_PORT)."""

    store_path: str | None = None  # one node: a FileStore here
    master_addr: str | None = None  # several nodes: tcp://master_addr:master_port
    master_port: int | None = None

    @classmethod
    def on_this_node(cls) -> "Rendezvous":
        folder = tempfile.mkdtemp(prefix="minivllm-tp-")  # mode 0700: this user's processes only
        return cls(store_path=os.path.join(folder, "store"))

    @classmethod
    def across_nodes(cls) -> "Rendezvous":
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ValueError("the tensor-parallel group spans nodes (LOCAL_WORLD_SIZE < tensor_parallel_size): set "
                             "MASTER_ADDR to this node's address and MASTER_PORT to a free port, and give the other "
                             "nodes' workers the same values")
        return cls(master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))

    def remove(self) -> None:
        """The store's folder, once the group is formed and gone (one node only)."""
        if self.store_path is not None:
            shutil.rmtree(os.path.dirname(self.store_path), ignore_errors=True)


def init_parallel_context(rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float,
                          device: torch.device) -> ParallelContext:
    """Join the group (blocks until all `world_size` ranks have joined, at most max(`timeout_s`,
    JOIN_TIMEOUT_S)); the groups' collectives then wait at most `timeout_s`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                           "engine?); shut that engine down first: torch allows one default group per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
    if rendezvous.store_path is not None:
        store = dist.FileStore(rendezvous.store_path, world_size)
        store.set_timeout(join)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=join)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
                                rank=rank, world_size=world_size, timeout=join)
    bounded = timedelta(seconds=timeout_s)
    device_group = dist.new_group(backend=backend, timeout=bounded)
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=bounded)
    wake_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT if rank > 0 else bounded)
    startup_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
    return ParallelContext(rank, world_size, device, device_group, cpu_group, wake_group, startup_group)


def close_parallel_context() -> None:
    """Leave the group (every group of this process); safe to call when there is none."""
    if dist.is_initialized():
        dist.destroy_process_group()
