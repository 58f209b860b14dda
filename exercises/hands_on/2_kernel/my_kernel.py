"""Hands-on 2: the same paged attention as a Triton kernel (run in Triton's interpreter on a CPU).

You write `paged_attention`: a @triton.jit kernel of your own and the function that launches it. The
grader wraps it in an attention backend that stores the step's k/v first (hands-on 1 did that), so the
kernel only reads the pool. Suggested plan, one program per (query row, query head):

    grid = (T, num_heads)
    program (row, head):
        seq  = the request that owns `row` (compute a (T,) row -> request table on the host and pass it)
        pos  = context_lens[seq] - query_len(seq) + (row - cu_seqlens_q[seq])   # the row's position
        q    = Q[row, head]                                                      # (HEAD_DIM,)
        m = -inf, l = 0, acc = 0                                                 # online softmax, fp32
        for j in range(pos // BLOCK_SIZE + 1):                                   # + 1: pos's own block too (inclusive)
            phys = block_tables[seq, j]
            K, V = k_cache[phys, :, kv_head], v_cache[phys, :, kv_head]           # (BLOCK_SIZE, HEAD_DIM)
            s = (K @ q) * scale, -inf where key position > pos
            m_new = max(m, max(s));  p = exp(s - m_new)
            l = l * exp(m - m_new) + sum(p);  acc = acc * exp(m - m_new) + p @ V;  m = m_new
        OUT[row, head] = acc / l

The rescale by exp(m - m_new) of both l and acc is the online softmax's whole idea (notebook 7); the
grader has a probe of its own for it. Take BLOCK_SIZE, HEAD_DIM and the head counts from the tensors'
shapes: the probes use blocks of 4 and 8 and heads of 16 and 32. The kernel must be yours and launched:
the grader refuses a file that calls the engine's kernels or computes the answer without launching a
@triton.jit function defined in it.

Pointers are flat: element (b, s, h, d) of a contiguous (num_blocks, BLOCK_SIZE, Hkv, D) cache is at
((b * BLOCK_SIZE + s) * Hkv + h) * D + d. q arrives as a strided view: make it contiguous (or pass its
strides). Use tl.arange over HEAD_DIM and BLOCK_SIZE (both powers of two here) and reductions
(tl.sum, tl.max) rather than tl.dot, which needs sides of at least 16. kernels/paged_attention.py is
the engine's own version (tiles of rows, tl.dot): read it after yours works.

Grade:  python -m minivllm.teaching.grade_hands_on kernel exercises/hands_on/2_kernel/my_kernel.py
        (without a GPU the grader sets TRITON_INTERPRET=1; from Python, set it before importing triton.
        1: the probes against naive_paged_attention; 2: the engine runs it on a tiny Qwen3 model,
        HF-exact. The interpreter is slow: part 2 takes a minute or two on a laptop)
"""

from __future__ import annotations

import torch


def paged_attention(
    q: torch.Tensor,  # (T, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    block_tables: torch.Tensor,  # (num_requests, max_blocks) int32, padded with 0
    cu_seqlens_q: torch.Tensor,  # (num_requests + 1,) int32: request i owns rows cu[i]:cu[i+1]
    context_lens: torch.Tensor,  # (num_requests,) int32: K/V length after this step (cached + new)
    scale: float,
) -> torch.Tensor:  # (T, num_heads, head_dim)
    """Launch your kernel: each row's causal attention over its request's paged context."""
    raise NotImplementedError
