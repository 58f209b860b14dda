"""CUDA graphs for decode steps: record a step's kernel launches once, then replay them with one call.

Why. A decode step of a small model on a GPU is bound by launching kernels, not by running them: each
of the ~10 kernels a layer needs (norms, matmuls, RoPE, the K/V write, attention) takes a few µs of
Python and driver time to launch and less than that to run. A CUDA graph records every launch of one
forward once (`torch.cuda.graph`), and `replay()` then sends them all to the GPU at once.

What a recording fixes. Each recorded launch keeps its arguments exactly: the addresses of its tensors,
its grid, its scalars. So a graph can only serve a step that
  * finds its inputs at the same addresses: the step's tensors are copied into static buffers
    (`input_ids`, `positions`, `slot_mapping`, `context_lens`, `block_tables`) that the graph reads;
  * has the same number of rows: one graph per size (the compiled forward's sizes), the step padded up;
  * launches nothing whose grid or scalars depend on this step's lengths. Attention reads each row's
    context length and block table inside the kernel, so one launch serves every length: the grouped
    decode kernel with a split count chosen from the rows alone (`TritonAttentionBackend.prepare_cuda_graph`).

    static buffers (max size N)           graph for 4 rows reads rows 0..3
    input_ids     [ t0 t1 t2 | 0 | ... ]   3 requests decode: rows 0..2 are theirs,
    context_lens  [ 9  17 5  | 1 | ... ]   row 3 is padding: a sequence of its own, context 1,
    block_tables  [ [..], [..], [..], [scratch] ]   whose K/V live in the scratch block

Padding rows are token 0 at position 0 in the scratch block that no request owns (as in the compiled
forward, models/compiled_forward.py), but here each is a one-row "request" attending to itself, so
every row of the graph computes something defined.

Which steps. Decode steps only (every request one new row, no drafts to verify) of at most the largest
size, on CUDA with the Triton attention backend and the compiled forward, on one rank. vLLM's
`enforce_eager=True` turns graphs off with the compiling. Prefill, mixed and larger steps run as before.
A size's graph is recorded the first time a step of that size runs: that step runs normally over the
static buffers first, because a recording must not be the first run of anything (Triton compiles a
kernel on its first launch, torch sets up its libraries on first use), then it is recorded. A recording
that fails (out of memory, say) is logged, and steps of that size run without a graph.

The recording is done by `capture`; on a GPU it is `cuda_graph_capture`. Tests on CPU pass
`replay_by_rerun`, which replays by running the recorded forward again over the same static buffers and
metadata: everything a graph does but the saving, so the buffers and padding are tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from minivllm.layers.attention import AttentionBackend, AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # (ids, pos, meta) -> (T, h)
Replay = Callable[[], torch.Tensor]  # runs the recorded forward again, returns its (T, hidden) output
Capture = Callable[[Replay], Replay]  # records a forward, returns how to replay it


def cuda_graph_capture(pool: tuple[int, int]) -> Capture:
    """Record with `torch.cuda.graph`. Every size's graph shares one memory pool (`pool`, from
    `torch.cuda.graph_pool_handle()`), as vLLM's do: a graph's scratch memory may be another's, and a
    size recorded later may even place its output where an earlier size's output was. That is safe
    because replays never overlap and each step reads its output before the next replay."""

    def capture(forward: Replay) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()  # recorded, not run: the output's memory is written at each replay

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def replay_by_rerun(forward: Replay) -> Replay:
    """The CPU stand-in for a recording (tests): a replay runs the recorded forward again."""
    return forward


class CUDAGraphRunner:
    """Decode steps of the sizes in `sizes` rows, each replayed from a graph recorded on its first run."""

    def __init__(self, sizes: tuple[int, ...], *, max_blocks_per_seq: int, scratch_block: int,
                 block_size: int, backend: AttentionBackend, device: torch.device, capture: Capture) -> None:
        self.sizes = tuple(sorted(sizes))
        self.scratch_block, self.block_size, self.backend, self.capture = scratch_block, block_size, backend, capture
        n = self.sizes[-1]
        # The static buffers every graph reads; rows past a step's requests are padding (see the docstring).
        # Made in inference mode, as a step's own inputs are: the compiled forward's guards tell the two
        # kinds of tensor apart, and a buffer of the other kind would make it compile the size again.
        with torch.inference_mode():
            self._allocate(n, max_blocks_per_seq, device)
        self.graphs: dict[int, Replay] = {}  # size -> replay of its recording
        # size -> the metadata its graph was recorded with. A graph reads every tensor at the address it
        # had when recorded, the attention plan's own (the tile lists) too: they must live as long as it.
        # (Freed after recording, they were reused and the graph read garbage: an illegal memory access.)
        self.metadata: dict[int, AttentionMetadata] = {}
        self.num_replays = 0

    def _allocate(self, n: int, max_blocks_per_seq: int, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # (N,)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # (N,)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)  # (N,)
        self.context_lens = torch.ones(n, **i32)  # (N,)
        self.block_tables = torch.full((n, max_blocks_per_seq), self.scratch_block, **i32)  # (N, max_blocks)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)  # (N + 1,): one row per "request"

    def can_run(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one a graph serves: decode rows only, padded to a size, tables that fit."""
        return (num_rows in self.sizes and all(q == 1 for q in meta.query_lens)
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            forward: Forward) -> torch.Tensor:
        """The step's hidden states (T, hidden), T = input_ids' rows (already padded to a size). The
        returned tensor is the graph's own output: read it before any other replay."""
        T, B = input_ids.shape[0], meta.num_seqs
        # --- this step's inputs into the static buffers (the padding rows' too: earlier steps may
        # have left a real request's lengths and blocks there) ---
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(meta.slot_mapping)  # padding rows: the scratch block's slot 0
        self.context_lens[:B].copy_(meta.context_lens)
        self.context_lens[B:T] = 1
        self.block_tables[:B, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.block_tables[B:T, 0] = self.scratch_block
        replay = self.graphs.get(T)
        if replay is not None:
            self.num_replays += 1
            return replay()
        # --- first step of this size: run it, then record it ---
        static = AttentionMetadata(slot_mapping=self.slot_mapping[:T], cu_seqlens_q=self.cu_seqlens_q[:T + 1],
                                   context_lens=self.context_lens[:T], block_tables=self.block_tables[:T],
                                   query_lens=[1] * T, context_lens_host=[1] * T, block_size=self.block_size)
        self.backend.prepare_cuda_graph(static)
        self.metadata[T] = static

        def recorded() -> torch.Tensor:
            return forward(self.input_ids[:T], self.positions[:T], static)

        hidden = recorded()  # (T, hidden): this step's result; it also builds every kernel the graph launches
        try:
            self.graphs[T] = self.capture(recorded)
        except Exception as error:  # e.g. out of memory: this size keeps running as before, the step is fine
            logging.getLogger("minivllm").warning("no CUDA graph for %d rows (%s: %s); those steps run without",
                                                  T, type(error).__name__, error)
            self.sizes = tuple(s for s in self.sizes if s != T)
            del self.metadata[T]
        return hidden

    def __repr__(self) -> str:
        return f"CUDAGraphRunner(sizes={self.sizes}, recorded={sorted(self.graphs)})"
