"""The paged-attention kernel read piece by piece, and its online softmax replayed block by block
(notebook 7).

`kernel_pieces` cuts the real kernel's source (`kernels/paged_attention.py`) at its `# --- phase ---`
banners, so the notebook shows the code that runs, not a copy of it.

`naive_online_softmax` is a teaching re-derivation: the kernel's loop for ONE decode row, written
in torch with the kernel's own names (m_i, l_i, acc, alpha, p), that keeps the state after every KV
block instead of only the last one:

    m_i   the largest score seen so far                    (starts at -inf)
    l_i   sum over seen keys of exp(score - m_i)           (starts at 0)
    acc   sum over seen keys of exp(score - m_i) * v       (starts at 0, a vector of head_dim)
    after block j:  acc / l_i = attention over the keys of blocks 0..j

`kernel_outputs_by_block` asks the real kernel for that last line: a decode row sees every key of
its context, so running the kernel with the context cut at the end of block j computes exactly the
attention over blocks 0..j. The notebook asserts that each replayed state equals the kernel's
output there, so the picture of m, l and acc is the kernel's arithmetic, checked, not a story.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from minivllm.kernels.paged_attention import _paged_attention_kernel, paged_attention, plan_tiles


class KernelPiece(NamedTuple):
    """One phase of the kernel's body: the banner's title and the lines under it."""

    title: str
    source: str


def kernel_pieces() -> list[KernelPiece]:
    """The paged-attention kernel's source, cut at its `# --- title ---` banners (the first piece,
    "signature", is the decorator, the arguments and what comes before the first banner)."""
    lines = inspect.getsource(_paged_attention_kernel.fn).splitlines()
    pieces, title, body = [], "signature", []
    for line in lines:
        banner = line.strip()
        if banner.startswith("# ---") and banner.endswith("---"):
            pieces.append(KernelPiece(title, "\n".join(body).rstrip()))
            title, body = banner.strip("# -"), []
        body.append(line)
    pieces.append(KernelPiece(title, "\n".join(body).rstrip()))
    return pieces


class SoftmaxState(NamedTuple):
    """The online-softmax state of one query row right after KV block `block` was read."""

    block: int  # logical block j of the request
    physical: int  # block_tables[i][j]: where its K/V live in the pool
    block_max: float  # the largest score among this block's visible keys
    m: float  # m_i: the running max
    l: float  # l_i: the running sum of exp(score - m_i)
    acc: torch.Tensor  # (head_dim,) the running sum of exp(score - m_i) * v

    @property
    def out(self) -> torch.Tensor:  # (head_dim,) attention over blocks 0..block
        return self.acc / self.l


def naive_online_softmax(q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         table: list[int], context_len: int, kv_head: int, scale: float) -> list[SoftmaxState]:
    """The kernel's loop for one decode row (position context_len - 1, so every key is visible),
    in fp32, keeping the state after each block. q_row: (D,); caches: (num_blocks, B, Hkv, D)."""
    B = k_cache.shape[1]
    m_i, l_i = torch.tensor(float("-inf")), torch.tensor(0.0)
    acc = torch.zeros(q_row.shape[-1])  # (D,)
    states = []
    for j in range(-(-context_len // B)):
        phys = table[j]
        k = k_cache[phys, :, kv_head].float()  # (B, D)
        v = v_cache[phys, :, kv_head].float()
        k_pos = j * B + torch.arange(B)
        s = (k @ q_row.float()) * scale  # (B,)
        s = s.masked_fill(k_pos >= context_len, float("-inf"))  # slots past the context
        m_new = torch.maximum(m_i, s.max())
        alpha = torch.exp(m_i - m_new)  # rescales what was summed under the old max
        p = torch.exp(s - m_new)  # (B,)
        l_i = l_i * alpha + p.sum()
        acc = acc * alpha + p @ v
        m_i = m_new
        states.append(SoftmaxState(j, phys, float(s.max()), float(m_i), float(l_i), acc.clone()))
    return states


def kernel_outputs_by_block(q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            table: list[int], context_len: int, scale: float) -> list[torch.Tensor]:
    """The real kernel's output for one decode row (all query heads), with the context cut at the
    end of each block in turn: entry j is attention over blocks 0..j. q_row: (Hq, D) -> (Hq, D) each."""
    B = k_cache.shape[1]
    tables = torch.tensor([table], dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    tiles = tuple(torch.tensor(t, dtype=torch.int32) for t in plan_tiles([1], 16))
    outs = []
    for j in range(-(-context_len // B)):
        cut = torch.tensor([min(context_len, (j + 1) * B)], dtype=torch.int32)
        out = paged_attention(q_row[None], k_cache, v_cache, tables, cu, cut, scale, tiles, 16)  # (1, Hq, D)
        outs.append(out[0])
    return outs
