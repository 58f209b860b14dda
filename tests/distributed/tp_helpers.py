"""Shared by the tensor-parallel tests: functions run on every rank through `collective_rpc` (they
must be importable by name in the workers, hence a module of their own), and process accounting."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from minivllm.engine.worker.model_runner import ModelRunner


def shard_summary(rank: int, runner: ModelRunner) -> dict:
    """What this rank holds: its KV pool's shape and its slices of the first layer's weights."""
    model = runner.model
    layer = model.model.layers[0]
    return dict(rank=rank, kv_cache=tuple(runner.kv_cache.shape), qkv=tuple(layer.self_attn.qkv_proj.weight.shape),
                o_proj=tuple(layer.self_attn.o_proj.weight.shape), gate_up=tuple(layer.mlp.gate_up_proj.weight.shape),
                embed=tuple(model.model.embed_tokens.weight.shape), lm_head=tuple(model.lm_head_weight.shape))


def raise_on_workers(rank: int, runner: ModelRunner) -> int:
    if rank > 0:
        raise ValueError(f"injected failure on rank {rank}")
    return rank


def interrupt_rank_0(rank: int, runner: ModelRunner) -> int:
    """Ctrl-C on rank 0 in the middle of a collective section."""
    if rank == 0:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs here
    return rank


def child_pids() -> set[int]:
    """This process's children (Linux: /proc/<pid>/task/*/children), but Python's multiprocessing
    resource tracker: the first spawned process starts it, and it serves the interpreter's lifetime."""
    pids: set[int] = set()
    for f in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        pids |= {int(p) for p in f.read_text().split()}
    return {pid for pid in pids if b"resource_tracker" not in _cmdline(pid)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # exited meanwhile
        return b""
