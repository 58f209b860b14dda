"""Asking a running tensor-parallel engine what each rank holds, and what one step sends.

    llm.collective_rpc(rank_shapes)                 every rank's weights and KV pool: shapes, in rank order
    count_collectives(lambda: llm.generate(...))    the collectives rank 0 made, by kind

`LLM.collective_rpc(fn)` runs `fn(rank, model_runner)` on every rank. The workers are separate
processes: `fn` reaches them pickled by reference (module and name) and is imported there, so it
must live in an importable module, never in a notebook cell. That is why `rank_shapes` is here.

`count_collectives` reads torch's profiler, which records every collective a process makes under
its backend's name ("gloo:all_reduce" on CPU, "nccl:all_reduce" on GPUs). It sees rank 0 only; the
ranks are in lockstep, so every rank makes the same collectives in the same order (a worker receives
the two broadcasts that rank 0 sends).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from minivllm.engine.worker.model_runner import ModelRunner


def rank_shapes(rank: int, runner: ModelRunner) -> dict[str, tuple[int, ...]]:
    """The shapes of what this rank holds: its embedding, first decoder layer and LM head, under the
    engine's own names (`qkv_proj` is q, k and v stacked by rows, `gate_up_proj` gate and up), and
    its KV pool, (layers, 2, blocks, block_size, KV heads, head_dim)."""
    model = runner.model
    shapes = {"embed_tokens.weight": tuple(model.model.embed_tokens.weight.shape)}
    shapes |= {name: tuple(p.shape) for name, p in model.model.layers[0].named_parameters()}
    shapes["lm_head.weight"] = tuple(model.lm_head_weight.shape)
    shapes["KV pool"] = tuple(runner.kv_cache.shape)
    return shapes


def count_collectives(fn: Callable[[], Any]) -> Counter[str]:
    """Run `fn()` under torch's profiler; the collectives this process made, by kind
    ("all_reduce", "gather", "broadcast", ...)."""
    # The profiler's C++ side logs every start and stop to stderr below this level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name.split(":", 1)[1] for e in prof.events() if e.name.startswith(("gloo:", "nccl:")))
