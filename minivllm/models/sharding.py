"""How tensor parallelism splits the Llama decoder and its MoE form: which slice of each tensor a rank holds.

With N ranks, rank r holds (H hidden, D head_dim, Hq / Hkv query / KV heads, I MLP width, V vocab):

    checkpoint tensor        shape       split along         rank r reads
    embed_tokens, lm_head    (V, H)      rows: vocabulary    rows [r V/N, (r+1) V/N)
    q_proj (+ bias)          (Hq D, H)   rows: heads         heads [r Hq/N, (r+1) Hq/N)
    k_proj, v_proj (+ bias)  (Hkv D, H)  rows: heads         heads [r Hkv/N, (r+1) Hkv/N), or, when
                                                             Hkv < N, the one head r Hkv // N (replicated)
    o_proj                   (H, Hq D)   columns: heads      the columns of its query heads
    gate_proj, up_proj (+b)  (I, H)      rows: MLP width     rows [r I/N, (r+1) I/N)
    down_proj                (H, I)      columns: MLP width  the columns of its rows of gate/up
  mixture of experts (models/qwen3_moe.py; Ie each expert's width, Is the shared expert's, E experts):
    experts.e.gate/up_proj   (Ie, H)     rows: expert width  rows [r Ie/N, (r+1) Ie/N) of every expert
      (fused: gate_up_proj   (E, 2Ie, H) the same rows of its gate half and of its up half)
    experts.e.down_proj      (H, Ie)     columns             the columns of its rows of gate/up
      (fused: down_proj      (E, H, Ie)  the same columns)
    shared_expert.*          as gate/up/down_proj above, with Is
    everything else          replicated: the RMSNorms, Qwen3's q_norm / k_norm (one (D,) weight
                             shared by every head), o_proj's and down_proj's biases (added once,
                             after the sum), the router (mlp.gate) and shared_expert_gate

A rank's query heads only ever read its own KV heads (GQA groups never straddle two ranks), so
attention needs no communication; o_proj and down_proj produce partial sums that one all-reduce
adds up (layers/parallel_linear.py). A MoE block is one more partial sum: its experts' and its shared
expert's outputs are added on each rank, then all-reduced once (every rank routes every token alike).

`ShardLayout.rank_spec` is the model as one rank sees it: a `ModelSpec` with its heads and its share
of the MLP (the vocabulary stays whole: sampling on rank 0 needs all of it). The decoder layers,
the KV pool and the attention backend are built from it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from minivllm.models.hf_config import ModelSpec


class WeightSlice(NamedTuple):
    dim: int  # 0: rows (output features), 1: columns (input features)
    start: int
    stop: int


def shard_refusal(spec: ModelSpec, world_size: int) -> str | None:
    """Why `spec` cannot be split over `world_size` ranks; None if it can."""
    if world_size == 1:
        return None
    if spec.linear_attn is not None:
        return (f"{spec.architecture} is a hybrid model (linear-attention layers with a recurrent state), "
                "which minivllm does not shard")
    if spec.sliding_window is not None:
        return (f"{spec.architecture} has sliding-window layers (a second KV-cache group), which minivllm "
                "does not shard")
    moe = spec.moe
    sizes = [(spec.num_attention_heads, "attention heads"), (spec.vocab_size, "vocabulary entries")]
    if moe is None or not all(moe.is_sparse(i) for i in range(spec.num_hidden_layers)):  # a dense MLP somewhere
        sizes.append((spec.intermediate_size, "MLP width (intermediate_size)"))
    if moe is not None:
        sizes.append((moe.moe_intermediate_size, "expert width (moe_intermediate_size)"))
        if moe.shared_expert_intermediate_size:
            sizes.append((moe.shared_expert_intermediate_size, "shared expert width (shared_expert_intermediate_size)"))
    for count, what in sizes:
        if count % world_size:
            return f"tensor_parallel_size={world_size} does not divide the model's {count} {what}"
    kv = spec.num_key_value_heads
    if kv % world_size and world_size % kv:
        return (f"tensor_parallel_size={world_size} neither divides the model's {kv} KV heads nor is a multiple "
                "of them (then each KV head would be replicated)")
    return None


def check_shardable(spec: ModelSpec, world_size: int) -> None:
    """Raise a ValueError saying what does not divide and which sizes would work."""
    reason = shard_refusal(spec, world_size)
    if reason is not None:
        sizes = [n for n in range(1, spec.num_attention_heads + 1) if shard_refusal(spec, n) is None]
        raise ValueError(f"{reason}; tensor_parallel_size must be one of {sizes} for this model")


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `world_size` holds; `of` refuses a model that does not divide."""

    rank: int
    world_size: int
    head_dim: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    kv_head_start: int  # the first of them, numbered as in the checkpoint
    intermediate_size: int  # this rank's share of the MLP width
    vocab_size: int  # this rank's rows of the embedding and of the LM head
    moe_intermediate_size: int = 0  # this rank's share of every expert's width (0: no experts)
    shared_expert_size: int = 0  # this rank's share of the shared expert's width (0: none)

    @classmethod
    def of(cls, spec: ModelSpec, rank: int, world_size: int) -> "ShardLayout":
        check_shardable(spec, world_size)
        n, kv = world_size, spec.num_key_value_heads
        if kv >= n:
            num_kv, kv_start = kv // n, rank * (kv // n)
        else:  # fewer KV heads than ranks: head h serves ranks h N/Hkv .. (h+1) N/Hkv - 1 (replicated)
            num_kv, kv_start = 1, rank * kv // n
        moe = spec.moe
        return cls(rank, n, spec.head_dim, spec.num_attention_heads // n, num_kv, kv_start,
                   spec.intermediate_size // n, spec.vocab_size // n,
                   moe.moe_intermediate_size // n if moe else 0, moe.shared_expert_intermediate_size // n if moe else 0)

    @property
    def vocab_start(self) -> int:  # the first token id of this rank's rows
        return self.rank * self.vocab_size

    def rank_spec(self, spec: ModelSpec) -> ModelSpec:
        """The model as this rank sees it: its heads, its share of the MLP and of every expert, the whole
        vocabulary (every expert and the router stay: each rank holds a slice of each expert)."""
        moe = spec.moe and replace(spec.moe, moe_intermediate_size=self.moe_intermediate_size,
                                   shared_expert_intermediate_size=self.shared_expert_size)
        return replace(spec, num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size, moe=moe)

    def checkpoint_slice(self, name: str) -> WeightSlice | None:
        """The part of checkpoint tensor `name` this rank reads; None: all of it (replicated)."""
        if self.world_size == 1:
            return None
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        r, mlp = self.rank, self.intermediate_size
        if "shared_expert" in parts:  # Qwen2-MoE's always-on expert: an MLP of its own width
            mlp = self.shared_expert_size
        elif "experts" in parts:  # one expert's gate/up/down_proj (asked by models/moe_weights.py `expert_copies`)
            mlp = self.moe_intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # this rank's rows of q, of k (v)
        if module in ("embed_tokens", "lm_head"):
            return WeightSlice(0, self.vocab_start, self.vocab_start + self.vocab_size)
        if module == "q_proj":
            return WeightSlice(0, r * q, (r + 1) * q)
        if module in ("k_proj", "v_proj"):
            start = self.kv_head_start * self.head_dim
            return WeightSlice(0, start, start + kv)
        if module in ("gate_proj", "up_proj"):
            return WeightSlice(0, r * mlp, (r + 1) * mlp)
        if module == "o_proj" and kind == "weight":
            return WeightSlice(1, r * q, (r + 1) * q)
        if module == "down_proj" and kind == "weight":
            return WeightSlice(1, r * mlp, (r + 1) * mlp)
        return None
