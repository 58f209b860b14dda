"""Tensor parallelism on torch.distributed: one process per rank, each holding a slice of every layer.

    parallel_state.py   `ParallelContext`: this process's rank and the process groups; the collectives
    communication.py    what rank 0 sends the workers (a typed command per step) and how
    executor.py         rank 0's side: start the workers, send each step, turn failures into EngineDeadError
    worker.py           a worker's side: build its shard, run every step's forward, until told to stop
    __main__.py         `python -m minivllm.distributed`: the workers of another node

Which slice of each weight a rank holds is `models/sharding.py`; the layers that communicate are
`layers/parallel_linear.py`. The picture and the failure model: docs/concepts/tensor-parallelism.md.
(This file imports nothing, so that `models/` can import `parallel_state` without a cycle.)
"""
