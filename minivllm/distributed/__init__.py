"""Tensor parallelism's plumbing on torch.distributed: one process per rank, each holding a slice of every layer.

    parallel_state.py   `ParallelContext`: this process's rank and the process groups; the collectives
    communication.py    `CommandChannel`: how rank 0 sends the workers one command at a time
    __main__.py         `python -m minivllm.distributed`: the workers of another node

This is the low layer: `layers/` and `models/` use `ParallelContext`, and it imports nothing of the
engine. The engine's side sits above it: `engine/executor/multiproc.py` (rank 0: start the workers,
send each step, turn failures into EngineDeadError) and `engine/executor/worker.py` (a worker: build its
shard, run every step's forward until told to stop). Which slice of each weight a rank holds is
`models/sharding.py`; the layers that communicate are `layers/parallel_linear.py`. The picture and the
failure model: docs/concepts/tensor-parallelism.md.
"""
