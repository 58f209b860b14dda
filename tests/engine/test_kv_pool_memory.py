"""The CPU KV pool's memory (engine/worker/kv_cache.py `zeros`): zeros until written, committed a page at a time,
never advised into huge pages (whose first write waits for the kernel to compact memory: ~0.5 s of a
30-layer model's first step), and private to the process that made it (a forked child writes its own copy)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from minivllm import LLM
from minivllm.engine.worker.kv_cache import zeros

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _vm_flags(start: int, size: int) -> set[str]:
    """The VmFlags of every mapping of this process that holds part of [start, start + size) (`man 5 proc`):
    an madvise of part of a mapping splits it, so each piece is read."""
    flags, inside, seen = set(), False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms offset ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + size and start < hi
                seen += inside
            elif inside and head == "VmFlags:":
                flags.update(line.split()[1:])
    assert seen, f"no mapping holds {start:#x}"
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_reads_as_zeros_and_keeps_what_is_written(dtype):
    pool = zeros((3, 2, 5, 4, 2, 8), dtype, torch.device("cpu"))  # (layers, 2, blocks, block_size, Hkv, D)
    assert pool.shape == (3, 2, 5, 4, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert float(pool.abs().sum()) == 0.0
    pool[2, 1, 4, 3] = 1.5
    assert float(pool.sum()) == 1.5 * 2 * 8 and float(pool[2, 1, 4, 3, 1, 7]) == 1.5


@linux_only
def test_the_engine_pool_is_not_advised_into_huge_pages(model_factory):
    llm = LLM(model_factory("qwen3"), warmup=False, cpu_kv_cache_bytes=64 << 20)
    pool = llm.llm_engine.model_runner.kv_cache
    assert pool.numel() * pool.element_size() >= 60 << 20  # large enough for numpy to have advised it
    flags = _vm_flags(pool.data_ptr(), pool.numel() * pool.element_size())
    assert "hg" not in flags, flags  # hg: MADV_HUGEPAGE (numpy's zeros advises it past its first page)
    llm.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_copy_of_the_pool():
    pool = zeros((2, 2, 4, 4, 1, 8), torch.float32, torch.device("cpu"))
    child = os.fork()
    if child == 0:  # the child: write everywhere, leave at once (no pytest teardown in the child)
        pool.fill_(7.0)
        os._exit(0 if float(pool.sum()) == 7.0 * pool.numel() else 1)
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) == 0
    assert float(pool.abs().sum()) == 0.0  # a shared mapping (mmap's default) would read the child's 7s
