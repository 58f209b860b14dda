"""The PyTorch attention backend under a sliding window: every path (decode rows by gather + SDPA or by the C++
kernel, prefill chunks after cached keys, whole prompts) against the naive reference, never reading a block
that left a window."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import give_back_before_windows, make_batch
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.paged_attention import naive_paged_attention
from minivllm.layers.attention_interface import AttentionMetadata
from minivllm.layers.torch_attention import DECODE_CANDIDATES, TorchAttentionBackend
from minivllm.cpu.tuner import forced


@pytest.mark.parametrize("kernel", [False, True])
def test_the_torch_backend_windows_every_row_and_never_reads_given_back_blocks(kernel):
    """Decode rows of unequal lengths, a prefill chunk after cached keys and a whole prompt, window 5, block 4:
    the backend (gather + SDPA, or the C++ kernel) against the naive reference, the blocks before each window
    pointing at a block of NaN."""
    if kernel and not load_cpu_kernels().available:
        pytest.skip("the C++ CPU kernels cannot be built here")
    window, query_lens, context_lens = 5, [1, 1, 1, 6, 9], [3, 17, 30, 20, 9]
    q, kc, vc, bt, cu, cl = make_batch(query_lens, context_lens, 4, 2, 16, 4, torch.float32)
    k_new = torch.randn(sum(query_lens), 2, 16)
    slots = torch.tensor([int(bt[i, p // 4]) * 4 + p % 4 for i, (n, c) in enumerate(zip(query_lens, context_lens))
                          for p in range(c - n, c)])
    kc.view(-1, 2, 16)[slots], vc.view(-1, 2, 16)[slots] = k_new, k_new  # what the backend will store
    ref = naive_paged_attention(q, kc, vc, bt, cu, cl, 0.25, window)
    kc, vc = give_back_before_windows(kc, vc, bt, cu, cl, window)
    backend = TorchAttentionBackend(4, 2, 16)
    backend.decode_kernel = forced(DECODE_CANDIDATES, DECODE_CANDIDATES[kernel], "test")
    meta = AttentionMetadata(slots, cu, cl, bt, query_lens, context_lens, 4, sliding_window=window)
    backend.prepare(meta)
    out = backend.forward(q, k_new, k_new, torch.stack([kc, vc]), meta).view_as(q)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
