"""Rotary position embeddings (RoPE), "rotate-half" (GPT-NeoX) layout as in HF Llama/Qwen.

For a head vector x split into halves (x1, x2) and per-pair frequency f_i, position p rotates
    x' = x * cos(p f) + rotate_half(x) * sin(p f),   rotate_half(x) = (-x2, x1)
The cos/sin table for every position up to `max_position` is built once, in float32, with sin's first
half negated so that a rotation needs no negation of its own (`rotate`). Models without a per-head q/k
norm rotate q's and k's heads in one call (they are neighbours in the fused qkv output).

On CPU, where warm-up measured it faster (minivllm/cpu/norm_rope_kernels.py sets `kernels`), a rotation is one call of
minivllm's C++ kernel (kernels/rotary_embedding.py) that reads the float32 tables at each row's position
itself: `lookup(..., kernel=True)` then hands it the whole tables and the positions instead of rows.

Frequencies: f_i = theta^(-2i/d). Scaled variants:
  * "linear": every f_i / factor.
  * "llama3": long wavelengths (> original_len / low_freq_factor) are divided by `factor`, short
    ones (< original_len / high_freq_factor) are kept, and the band between is interpolated
    smoothly between the two (Llama 3.1's recipe for extending the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minivllm.kernels.rotary_embedding import rotary_embedding
from minivllm.layers.custom_op import KernelSwitch


@dataclass(frozen=True)
class RopeSpec:
    """A checkpoint's RoPE settings (read from config.json by `models/hf_config.py`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:  # (head_dim // 2,)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, smoothed, scaled)
    return inv_freq


class RopeTables(NamedTuple):
    """What a step's layers rotate with (`RotaryEmbedding.lookup`)."""

    cos: torch.Tensor  # (T, 1, D) in the model's dtype; with `positions`: the whole (P, D) float32 table
    signed_sin: torch.Tensor  # the same shape; sin's first half negated (see `rotate`)
    positions: torch.Tensor | None = None  # (T,) set: the C++ kernel reads the tables' rows itself


class RotaryEmbedding:
    """Holds the (max_position, head_dim) cos and signed-sin tables. A step looks up its positions once
    (`lookup`) and every layer applies the result (`rotate`, or `apply_rotary` for q and k apart)."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeSpec, device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, rope).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (max_position, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_position, head_dim)
        self.cos = emb.cos()
        self.signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # (max_position, D): (-sin, sin)
        self.kernels: KernelSwitch | None = None  # set at warm-up where the C++ kernel is faster; None: torch's ops

    def kernel_runs(self, x: torch.Tensor) -> bool:
        """Whether a step whose hidden states are `x` rotates with the C++ kernel (pass it to `lookup`)."""
        return self.kernels is not None and self.kernels.active(x)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, kernel: bool = False) -> RopeTables:
        """positions (T,) -> cos, sin (T, 1, D), broadcast over heads; sin's first half is negated,
        which is rotate_half's minus sign moved into the table (see `rotate`). With `kernel`, nothing is
        looked up: the C++ kernel gets the whole float32 tables and the positions."""
        if kernel:
            return RopeTables(self.cos, self.signed_sin, positions)
        return RopeTables(self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype))


def rotate(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x (T, H, D) rotated by the positions `lookup` read: x * cos + rotate_half(x) * sin.

    rotate_half(x) * sin = (-x2, x1) * (s1, s2) = (x2, x1) * (-s1, s2): swapping the halves is one `flip`
    of a (2, D/2) view and the minus sign already sits in the table, so a rotation runs four kernels (flip
    and three arithmetic ops) instead of five (neg, cat and the same three). Negating a factor is exact in
    floating point, so the result is bit-identical to the textbook form and to HF's: the same products
    rounded the same way (a fused multiply-add would round once fewer, and differ). The C++ kernel
    computes the same, bit for bit, in one pass."""
    if tables.positions is not None:
        return rotary_embedding(x, tables.positions, tables.cos, tables.signed_sin)
    cos, signed_sin = tables.cos, tables.signed_sin
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (T, H, D): halves swapped, (x2, x1)
    return x * cos + swapped * signed_sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(q, tables), rotate(k, tables)  # q (T, Hq, D), k (T, Hkv, D)
