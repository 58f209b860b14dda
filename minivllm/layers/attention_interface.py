"""What the model and an attention backend agree on: the per-step metadata and the backend's interface.

Every step is one flat "varlen" batch: the new tokens of all scheduled requests, back to back
(drawn with block_size 4: slot = block * 4 + offset).

    tokens       [ a0 a1 a2 a3 | b0 | c0 c1 ]          T = 7 rows, B = 3 requests
    cu_seqlens_q [0,            4,   5,     7]          request i owns rows cu[i]:cu[i+1]
    context_lens [4,            9,   6]                 K/V length after this step (cached + new)
    block_tables [[3, 8, -], [1, 5, 6], [2, 4, -]]      physical blocks, padded with 0 (masked)
    slot_mapping [12 13 14 15 | 24 | 16 17]             where each row's new K/V is stored

A request's query rows are the *last* `query_len` positions of its context: rows that are decode
(query_len 1), a prefill chunk, or a chunk after a cached prefix all look the same. Row r of
request i sits at position `context_len - query_len + r` and may attend to keys 0..that position.

Sliding-window layers (Gemma 3) see only the last `sliding_window` keys of each query (its own
included: row at position p attends to keys p - W + 1 .. p). They keep their K/V in a pool of their
own, with their own block tables (engine/core/kv_cache_groups.py), so they get metadata of their own too:
`meta.sliding`, the same rows with that group's `block_tables`, `slot_mapping` and the window. Its
tables hold 0 where a block left the window (it was given back): a backend must not read those.

A backend receives q/k/v for the flat batch and the layer's slice of the paged cache, stores the
new k/v at `slot_mapping`, and returns attention over each request's whole context.

Why a module of its own: the backends (`torch_attention.py`, `triton_attention.py`) subclass
`AttentionBackend`, and the factory that picks one (`attention.py`) imports the backends. With the
interface here, imports point one way only: factory -> backends -> interface.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer's attention (the picture in the module docstring)."""

    slot_mapping: torch.Tensor  # (T,) int64, flat slot = block * block_size + offset
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    context_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    query_lens: list[int]  # host copies of the shapes, so backends need not sync with the device
    context_lens_host: list[int]
    block_size: int
    # What the backend's `prepare` built for this step (index tensors, masks), of the backend's own type:
    # each backend reads back only the plan it made (and checks it is one).
    plan: object | None = field(default=None)
    sliding_window: int | None = None  # W: a row sees only its last W keys (None: its whole context)
    sliding: AttentionMetadata | None = None  # the sliding-window layers' own layout (None: no such layers)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @functools.cached_property  # read by every layer's attention: summed once a step
    def num_tokens(self) -> int:
        """The requests' rows; a compiled step may carry more (padding, after these: their K/V go to a
        scratch slot and their attention output is zero)."""
        return sum(self.query_lens)


class AttentionBackend(abc.ABC):
    """What the model needs from attention: the seam for a backend of your own. One instance serves every
    layer, and each step runs, in this order:

        prepare(meta)                       once a step, before the first layer: per-step work shared by
                                            all layers (index tensors, masks), kept in `meta.plan`
        forward(q, k, v, kv_cache, meta)    once per layer: store the T new rows' k and v in `kv_cache`
                                            at `meta.slot_mapping` (flat slot = block * block_size + offset),
                                            then return, for each request's query rows, attention over its
                                            whole context (the cached prefix, then the rows, causally)

    Rows past `meta.num_tokens` (a compiled step's padding) get zeros. Built-in: "torch" and "triton"
    (`attention.py`); yours is passed as `LLM(model, attention_backend=MyBackend(num_heads, num_kv_heads,
    head_dim))`: the engine checks those three against the model, and refuses it with tensor_parallel_size > 1
    or a draft model (one instance serves one model's heads on one rank)."""

    name: str = "abstract"
    # Whether `forward` honours `meta.sliding_window` (the engine refuses a model with sliding layers otherwise).
    supports_sliding_window: bool = False
    # Whether `prepare_cuda_graph` exists: decode steps replayed from CUDA graphs (engine/worker/cuda_graphs.py).
    supports_cuda_graphs: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads (GQA)"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers (index tensors, masks); stored in `meta.plan`."""

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """`prepare` for a CUDA graph: one plan for decode rows of any length (every row one request,
        the lengths only in `meta`'s tensors, which later steps overwrite in place)."""
        raise NotImplementedError(f"the {self.name} attention backend does not run inside CUDA graphs")

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim): keys, values
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, num_heads * head_dim)
        ...
