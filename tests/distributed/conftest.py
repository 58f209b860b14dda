"""Fixtures of the tensor-parallel tests: a model whose KV heads must be replicated, and one CPU
thread per rank (two ranks on two cores: torch's default of one thread per core each would make
four threads fight over two cores)."""

from __future__ import annotations

import pytest
import torch

from minivllm.teaching.checkpoints import make_tiny_model


@pytest.fixture(scope="session")
def kv1_dir(tmp_path_factory) -> str:
    """4 query heads, 1 KV head: with 2 ranks each holds 2 query heads and a copy of the KV head."""
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3_kv1"), family="qwen3", num_kv_heads=1))


@pytest.fixture
def one_thread_per_rank():
    """The workers take rank 0's thread count (engine/executor/worker.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
