"""The Triton attention backend: the kernels in `kernels/` behind the `AttentionBackend` interface.

Per step (`prepare`), the backend chooses between two kernels:
  * `paged_attention` for any batch (decode rows, prefill chunks, cached prefixes), one launch;
  * `split_kv_decode` (flash-decoding) when the batch is ALL decode rows, few of them and long: the
    plain kernel would launch num_rows x num_heads programs, each walking a long context alone.
    Rule: rows x heads < 2 x (streaming multiprocessors) and the longest context spans >= 8 blocks;
    the number of splits fills ~2 waves of SMs, at most 16, and at least 2 blocks per split.
    On CPU (the interpreter) there is no SM count; 8 is used, which keeps tests exercising both.
Inside a CUDA graph (`prepare_cuda_graph`, engine/cuda_graphs.py) the plan cannot look at the lengths:
the same rule without the length test, as each kernel reads every row's length when it runs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class _TritonPlan(NamedTuple):
    tiles: tuple[torch.Tensor, torch.Tensor] | None  # for paged_attention
    num_splits: int  # > 0: use split-KV decode


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_sliding_window = True
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on CPU runs in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before starting Python (or use attention_backend='torch')")
        from minivllm.kernels import paged_attention as pa
        from minivllm.kernels import split_kv_decode as sk
        from minivllm.kernels.kv_cache_write import kv_cache_write

        pa.check_shapes(head_dim, block_size)
        self._pa, self._sk, self._write = pa, sk, kv_cache_write
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.block_m = 16

    def prepare(self, meta: AttentionMetadata) -> None:
        rows_x_heads = meta.num_seqs * self.num_heads
        max_blocks = -(-max(meta.context_lens_host) // meta.block_size)
        if all(q == 1 for q in meta.query_lens) and rows_x_heads < 2 * self.num_sms and max_blocks >= 8:
            splits = max(2, min(16, -(-2 * self.num_sms // rows_x_heads), max_blocks // 2))
            meta.plan = _TritonPlan(None, splits)
            return
        tile_seq, tile_start = self._pa.plan_tiles(meta.query_lens, self.block_m)
        device = meta.slot_mapping.device
        tiles = (torch.tensor(tile_seq, dtype=torch.int32, device=device),
                 torch.tensor(tile_start, dtype=torch.int32, device=device))
        meta.plan = _TritonPlan(tiles, 0)

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        # Nothing here may depend on the lengths, which only meta's tensors hold (a graph replays for any).
        # Both kernels read each row's length and blocks when they run: split-KV where `prepare` would
        # choose it for long contexts (few rows), its split count from the rows alone (a short context
        # leaves some splits empty, which the merge weighs 0); else the one-pass kernel, a tile per row.
        n, device = meta.num_seqs, meta.slot_mapping.device
        if n * self.num_heads < 2 * self.num_sms:
            meta.plan = _TritonPlan(None, max(2, min(16, -(-2 * self.num_sms // (n * self.num_heads)))))
            return
        tiles = (torch.arange(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device))
        meta.plan = _TritonPlan(tiles, 0)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        plan = meta.plan
        assert isinstance(plan, _TritonPlan), "prepare(meta) must run before forward: meta.plan is not this backend's"
        self._write(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        if plan.num_splits:
            n = meta.num_seqs  # the requests' rows; a compiled step's padding rows after them get zeros
            out = self._sk.split_kv_decode(q[:n], kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens,
                                           self.scale, plan.num_splits, meta.sliding_window or 0)  # (n, Hq, D)
            if n < T:
                out = torch.cat([out, out.new_zeros(T - n, *out.shape[1:])])
        else:
            out = self._pa.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q,
                                           meta.context_lens, self.scale, plan.tiles, self.block_m,
                                           meta.sliding_window or 0)
        return out.view(T, self.num_heads * self.head_dim)
