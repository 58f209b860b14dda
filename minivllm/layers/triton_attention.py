"""The Triton attention backend: the kernels in `kernels/` behind the `AttentionBackend` interface.

Per step (`prepare`), the backend chooses between two kernels:
  * `grouped_decode_attention` when the batch is ALL decode rows: one program per (request, KV head
    [, split]) whose tile rows are the G query heads sharing that KV head, so each KV block is read
    once a step, not G times; the contexts are cut into `choose_num_splits(rows, KV heads, longest
    context, SMs)` ranges (flash-decoding) when the rows alone cannot fill the GPU;
  * `paged_attention` for any other batch (prefill chunks, cached prefixes, decode rows beside them),
    one launch.
On CPU (the interpreter) there is no SM count; 8 is used, which keeps tests exercising the splits.
Inside a CUDA graph (`prepare_cuda_graph`, engine/worker/cuda_graphs.py) the plan cannot look at the lengths:
the grouped kernel with the split count from the rows alone (a short context leaves some splits empty,
which the merge weighs 0), as the kernel reads every row's length when it runs.
`batch_invariant=True` fixes the split count (kernels/grouped_decode_attention.py), so a decode row's sum
order depends on its own length only; the engine's batch-invariant mode itself runs the per-row backend
(layers/per_row_attention.py) and refuses CUDA for now (config.py), so only a caller building this
backend directly gets it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata


class _TritonPlan(NamedTuple):
    tiles: tuple[torch.Tensor, torch.Tensor] | None  # for paged_attention (None: a decode-only step)
    num_splits: int  # > 0: a decode-only step, grouped_decode_attention with this many splits


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_sliding_window = True
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 block_size: int, batch_invariant: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on CPU runs in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before starting Python (or use attention_backend='torch')")
        from minivllm.kernels import grouped_decode_attention as gd
        from minivllm.kernels import paged_attention as pa
        from minivllm.kernels.kv_cache_write import kv_cache_write

        pa.check_shapes(head_dim, block_size)
        self._pa, self._gd, self._write = pa, gd, kv_cache_write
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.block_m = 16
        self.batch_invariant = batch_invariant

    def prepare(self, meta: AttentionMetadata) -> None:
        if all(q == 1 for q in meta.query_lens):
            splits = self._gd.choose_num_splits(meta.num_seqs, self.num_kv_heads, max(meta.context_lens_host),
                                                self.num_sms, self.batch_invariant)
            meta.plan = _TritonPlan(None, splits)
            return
        tile_seq, tile_start = self._pa.plan_tiles(meta.query_lens, self.block_m)
        device = meta.slot_mapping.device
        tiles = (torch.tensor(tile_seq, dtype=torch.int32, device=device),
                 torch.tensor(tile_start, dtype=torch.int32, device=device))
        meta.plan = _TritonPlan(tiles, 0)

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        # Nothing here may depend on the lengths, which only meta's tensors hold (a graph replays for any).
        splits = self._gd.choose_num_splits(meta.num_seqs, self.num_kv_heads, None, self.num_sms,
                                            self.batch_invariant)
        meta.plan = _TritonPlan(None, splits)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        plan = meta.plan
        assert isinstance(plan, _TritonPlan), "prepare(meta) must run before forward: meta.plan is not this backend's"
        self._write(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        if plan.num_splits:
            n = meta.num_seqs  # the requests' rows; a compiled step's padding rows after them get zeros
            out = self._gd.grouped_decode_attention(q[:n], kv_cache[0], kv_cache[1], meta.block_tables,
                                                    meta.context_lens, self.scale, plan.num_splits,
                                                    meta.sliding_window or 0)  # (n, Hq, D)
            if n < T:
                out = torch.cat([out, out.new_zeros(T - n, *out.shape[1:])])
        else:
            out = self._pa.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q,
                                           meta.context_lens, self.scale, plan.tiles, self.block_m,
                                           meta.sliding_window or 0)
        return out.view(T, self.num_heads * self.head_dim)
