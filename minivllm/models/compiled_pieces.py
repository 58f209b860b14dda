"""Piecewise compilation: `torch.compile` the code *between* attention calls, for a few token counts.

A decoder layer is mostly small element-wise operations around a few matmuls:

    h ─ RMSNorm ─ qkv_proj ─ split ─ (q/k norm) ─ RoPE ─┐            pre_attention   (compiled)
                                                        attention                    (eager)
    h ──────────────────────────── + ─ o_proj ──────────┘─ RMSNorm ─ gate_up ─ silu·up ─ down ─ +
                                                                                     post_attention (compiled)

Run eagerly, every one of those operations is a separate kernel launch with its own Python dispatch
and its own trip through memory: a single decode row of SmolLM2 spends about as long there as in the
matmuls. Inductor (`torch.compile`'s default backend) fuses them into a few generated loops.

Attention is the part whose shapes change every step (how many requests, how long each context), so,
as vLLM does, it stays *outside* the compiled pieces: each layer is two pieces, `pre_attention` and
`post_attention`, and the model calls attention between them.

Shapes. A compiled graph is specialised to its input shapes, and the pieces' only varying dimension is
T, the number of token rows in the step. So graphs are made for a few sizes only (`sizes`, e.g.
1, 2, 4, ..., 128), and the model runner pads each step's rows up to the next size: 3 rows run the
graph for 4. A padding row is token 0 at position 0; its K/V is stored in a scratch block that no
request ever owns (engine/model_runner.py), and attention gives it no output, so it changes no real row.
Steps with more rows than the largest size (long prefills, where the matmuls dominate anyway) run eagerly.

One graph per size serves every layer: the pieces take the layer module as an argument, and
torch.compile treats its parameters as graph inputs rather than constants. The matmuls inside stay the
kernels the CPU matmul plan measured (layers/linear.py hands them to Inductor as opaque ops), so
Inductor changes only what lies between them.

On CUDA the pieces are compiled with `mode="reduce-overhead"`, which also captures each piece as a
CUDA graph per size: a decode step becomes a few graph replays around the attention kernels.

`enforce_eager=True` (vLLM's name) turns all of it off.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

Piece = Callable[..., Any]

DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def padded_num_tokens(sizes: tuple[int, ...], num_tokens: int) -> int:
    """The smallest compiled size >= `num_tokens`, or `num_tokens` itself when it is larger than all of
    them (that step runs eagerly). `sizes` is sorted."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else num_tokens


class CompiledPieces:
    """The compiled `pre_attention` / `post_attention` of one layer class, for the token counts in `sizes`."""

    def __init__(self, pre: Piece, post: Piece, sizes: tuple[int, ...], device: torch.device) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        # Dynamo keeps one graph per size for each piece's code; its default limit (8) would make it give
        # up on the ninth size and run that piece eagerly from then on.
        limit = max(torch._dynamo.config.recompile_limit, len(self.sizes) + 2)
        torch._dynamo.config.recompile_limit = limit
        mode = "reduce-overhead" if device.type == "cuda" else None  # + CUDA graphs per size
        self.pre = torch.compile(pre, dynamic=False, fullgraph=True, mode=mode)
        self.post = torch.compile(post, dynamic=False, fullgraph=True, mode=mode)

    def for_tokens(self, num_tokens: int) -> tuple[Piece, Piece] | None:
        """The compiled pieces for a step of `num_tokens` rows (already padded); None: run eagerly."""
        return (self.pre, self.post) if num_tokens in self.sizes else None

    def __repr__(self) -> str:
        return f"CompiledPieces(sizes={self.sizes})"
